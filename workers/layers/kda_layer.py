"""Kimi Delta Attention (KDA) layer, as Kimi-Linear's linear-attention layers run it.

Per token: q, k, v projections, each through a short depthwise causal conv with SiLU; a
per-channel forget gate g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias); beta =
sigmoid(b_proj(x)); the KDA recurrence (q, k L2-normalised in the kernel); then a gated RMSNorm
per head, norm(o) * sigmoid(g_b(g_a(x))), and o_proj.

Projections that read x share a GEMM, since a batch-1 decode step is bound by launches, not
bytes: `qkv_proj` gives q | k | v | beta's logits, `fg_a_proj` gives f_a | g_a; with f_b,
g_b and o_proj that is 5 launches per layer. A fused layer has one quantization scheme, so
where a checkpoint quantizes b_proj (or f_a / g_a) unlike its partners, the model builds it
as its own linear instead (`fuse_b_proj`, `fuse_fg_a`).

State: a request owns one page of the linear-state group, holding the conv state of all three
convolutions (channels q | k | v, the last K-1 inputs each) and the recurrent state
[H, Dk, Dv]. Which rows read that page comes from `batch.rows` alone (invariant 1): decode
rows (resume rows of one token) take the single-step kernels in place on the pool; prefill
rows (fresh rows and multi-token resume rows) take the chunked kernels with
`has_initial_state` from the classification, so a fresh row never reads its slot, which may
hold another request's state or NaN (sanitizer). Prefill rows write their final states back.

Tensor parallelism splits heads: qkv_proj (each of q, k, v and beta's logits), f_b and g_b
are column-parallel by head, dt_bias and A_log follow; fg_a_proj (hidden -> 2 * head_dim)
is replicated; o_proj is row-parallel.
"""

from __future__ import annotations

import torch
from torch import nn

from kvloom.kernels import batch_invariant as bi
from kvloom.kernels.dispatch import batch_invariant
from kvloom.kernels.ops import (
    causal_conv1d_update,
    causal_conv1d_varlen,
    chunk_kda,
    kda_decode_step,
    kda_gated_norm,
    kda_gates,
    recurrent_kda,
)
from kvloom.workers.attention_metadata import ForwardBatch
from kvloom.workers.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    check_shape,
)
from kvloom.workers.layers.linear_state_pages import (
    LinearStatePages,
    mixed_step_choice,
    serial_rows,
    uniform_resume_len,
)
from kvloom.workers.layers.tp_group import LocalGroup, TPGroup, shard_range
from kvloom.workers.linear_rows import LinearRows
from kvloom.workers.row_kinds import RowClasses

# Split mixed steps (KVLOOM_KDA_MIXED_STEPS=split): rows longer than this take the chunked
# kernels, the rest go token by token (Gated DeltaNet's SPLIT_ROW_TOKENS, fla's chunk).
SPLIT_ROW_TOKENS = 64


def mixed_step_path(rows: RowClasses, device: torch.device) -> str:
    """How a KDA layer serves a step that is neither decode-only nor a uniform resume:
    "chunked" (prefill rows through the chunked kernels, decode rows through the single-step
    ones), "serial" (every row token by token through the serial kernels, in place on the
    pool: no state gathers, no host-side chunk layout) or "split" (rows of more than
    SPLIT_ROW_TOKENS tokens chunked, the rest serial). KVLOOM_KDA_MIXED_STEPS picks one;
    auto takes serial where Gated DeltaNet's rule does (`serial_suits`), else chunked."""
    return mixed_step_choice("KVLOOM_KDA_MIXED_STEPS", rows, device)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's output times sigmoid(gate), all in float32 (float64 for
    float64 input), as transformers' KimiLinearRMSNormGated (kernels/kda_gated_norm.py)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), False)

    def load_shard(self, param_name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        check_shape(param_name, loaded, tuple(self.weight.shape))
        self.weight.data.copy_(loaded)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # One launch at decode on CUDA in half precision, else the torch composition.
        return kda_gated_norm(x, gate, self.weight, self.eps)


class FusedShortConv(nn.Module):
    """The q, k and v depthwise conv weights as one [3 * D_local, K] weight (channels
    q | k | v, this rank's heads of each), loaded from three [D, 1, K] checkpoint tensors."""

    num_shards = 3

    def __init__(self, channels: int, kernel_size: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.channels = channels
        self.local = channels // tp.world_size
        self.weight = nn.Parameter(torch.empty(3 * self.local, kernel_size, dtype=dtype), False)

    def load_shard(self, param_name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        check_shape(param_name, loaded, (self.channels, 1, self.weight.shape[1]))
        start, end = shard_range(self.channels, self.tp.rank, self.tp.world_size, "conv channels")
        self.weight.data[shard * self.local : (shard + 1) * self.local].copy_(loaded[start:end, 0])


class KimiDeltaAttention(LinearStatePages, nn.Module):
    def __init__(
        self,
        layer_index: int,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        conv_kernel_size: int,
        rms_norm_eps: float,
        activation: str = "silu",
        tp: TPGroup | None = None,
        dtype: torch.dtype = torch.float32,
        fuse_b_proj: bool = True,
        fuse_fg_a: bool = True,
    ):
        super().__init__()
        tp = tp or LocalGroup()
        if num_heads % tp.world_size:
            raise ValueError(
                f"linear_attn_config.num_heads ({num_heads}) must be divisible by "
                f"tensor_parallel_size ({tp.world_size})"
            )
        if conv_kernel_size < 2:
            raise ValueError(
                f"linear_attn_config.short_conv_kernel_size must be at least 2, "
                f"got {conv_kernel_size}"
            )
        self.layer_index = layer_index
        self.tp = tp
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.world_size
        self.conv_kernel_size = conv_kernel_size
        self.activation = activation
        width = num_heads * head_dim
        self.local_width = self.num_heads * head_dim
        # q | k | v, then beta's logits where fused: each part split by head over ranks.
        parts = [width] * 3 + ([num_heads] if fuse_b_proj else [])
        self.qkv_proj = ColumnParallelLinear(hidden_size, parts, tp=tp, dtype=dtype)
        self.b_proj = None
        if not fuse_b_proj:
            self.b_proj = ColumnParallelLinear(hidden_size, [num_heads], tp=tp, dtype=dtype)
        # f_a | g_a, whole on every rank: a one-rank group makes the fused linear replicated.
        self.fg_a_proj = self.f_a_proj = self.g_a_proj = None
        if fuse_fg_a:
            self.fg_a_proj = ColumnParallelLinear(
                hidden_size, [head_dim] * 2, tp=LocalGroup(), dtype=dtype
            )
        else:
            self.f_a_proj = ReplicatedLinear(hidden_size, head_dim, dtype=dtype)
            self.g_a_proj = ReplicatedLinear(hidden_size, head_dim, dtype=dtype)
        self.conv1d = FusedShortConv(width, conv_kernel_size, tp, dtype)
        self.f_b_proj = ColumnParallelLinear(head_dim, [width], tp=tp, dtype=dtype)
        self.g_b_proj = ColumnParallelLinear(head_dim, [width], tp=tp, dtype=dtype)
        self.o_norm = GatedRMSNorm(head_dim, rms_norm_eps, dtype)
        self.o_proj = RowParallelLinear(width, hidden_size, tp=tp, dtype=dtype)
        # Forget-gate parameters, loaded by this module (checkpoint: self_attn.A_log/dt_bias).
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=dtype), False)
        self.dt_bias = nn.Parameter(torch.empty(self.local_width, dtype=dtype), False)
        self.num_heads_total = num_heads
        self.conv_state: torch.Tensor | None = None  # [num_blocks, 3 * D_local, K - 1]
        self.recurrent_state: torch.Tensor | None = None  # [num_blocks, H_local, Dk, Dv]

    # -- weights ----------------------------------------------------------------------
    def load_shard(self, param_name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        """A_log (checkpoint [1, 1, H, 1], one per head) and dt_bias ([H * Dh]): this rank's
        heads."""
        world, rank = self.tp.world_size, self.tp.rank
        if param_name == "A_log":
            if loaded.numel() != self.num_heads_total:
                raise ValueError(
                    f"A_log: expected {self.num_heads_total} values (one per head), "
                    f"got shape {tuple(loaded.shape)}"
                )
            start, end = shard_range(self.num_heads_total, rank, world, "KDA heads")
            self.A_log.data.copy_(loaded.reshape(-1)[start:end])
        elif param_name == "dt_bias":
            width = self.num_heads_total * self.head_dim
            check_shape(param_name, loaded, (width,))
            start, end = shard_range(width, rank, world, "KDA heads")
            self.dt_bias.data.copy_(loaded[start:end])
        else:
            raise ValueError(f"unexpected KDA parameter {param_name!r}")

    # -- cache ------------------------------------------------------------------------
    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (3 * self.local_width, self.conv_kernel_size - 1)

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.head_dim)

    def allocate_cache(self, pages: torch.Tensor, spec) -> None:
        if (tuple(spec.conv_state_shape), tuple(spec.recurrent_state_shape)) != (
            self.conv_state_shape,
            self.recurrent_state_shape,
        ):
            raise ValueError(f"layer {self.layer_index}: LinearStateSpec does not match the layer")
        super().allocate_cache(pages, spec)

    # -- forward ----------------------------------------------------------------------
    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, projected: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden]. `projected`: qkv_proj(hidden), computed by the
        caller (the decoder layer fuses its input norm into that GEMV)."""
        num_tokens = hidden.shape[0]
        heads = (num_tokens, self.num_heads, self.head_dim)
        slots = batch.group_for(self.layer_index).state_indices
        mixed, beta_logits, f_a, g_a = self._project(hidden, projected)
        raw_gate = self.f_b_proj(f_a).view(heads)
        gate = self.g_b_proj(g_a).view(heads)
        if batch.decode_only:
            out = self._decode_normed(mixed, raw_gate, beta_logits, gate, slots)
            return self.o_proj(out.reshape(num_tokens, -1))

        # g float32 [T, H, Dk], beta in the activations' dtype: one launch on CUDA.
        g, beta = kda_gates(raw_gate, self.A_log, self.dt_bias, beta_logits)
        resume = uniform_resume_len(batch, num_tokens)
        if resume is not None:  # a verification: token by token, no host-side bounds
            core = self.resume_token_by_token(mixed, g, beta, slots, resume)
        else:
            core = self._mixed_step(mixed, g, beta, slots, batch)
        out = self.o_norm(core, gate).reshape(num_tokens, -1)
        return self.o_proj(out)

    def _project(self, hidden: torch.Tensor, projected: torch.Tensor | None = None):
        """q | k | v (the convs' input), beta's logits and the forget and output gates'
        low-rank inputs f_a, g_a: two GEMMs where fused. The parts are views of the fused
        outputs (strided rows, which every consumer reads). `projected`: qkv_proj's output,
        computed by the caller."""
        mixed = self.qkv_proj(hidden) if projected is None else projected
        if self.b_proj is None:
            mixed, beta_logits = mixed.split([3 * self.local_width, self.num_heads], dim=-1)
        else:
            beta_logits = self.b_proj(hidden)
        if self.fg_a_proj is None:
            return mixed, beta_logits, self.f_a_proj(hidden), self.g_a_proj(hidden)
        f_a, g_a = self.fg_a_proj(hidden).split(self.head_dim, dim=-1)
        return mixed, beta_logits, f_a, g_a

    def _mixed_step(self, mixed, g, beta, slots, batch: ForwardBatch) -> torch.Tensor:
        """A step of prefill and decode rows -> the core output [T, H, D], by
        `mixed_step_path`: chunked (prefill rows chunked, decode rows single-step), serial
        or split (long rows chunked, the rest serial)."""
        path = mixed_step_path(batch.rows, mixed.device)
        if path == "serial":
            return self._serial_all(mixed, g, beta, slots, batch)
        if path == "split":
            return self._split_step(mixed, g, beta, slots, batch, SPLIT_ROW_TOKENS)
        core = mixed.new_zeros((mixed.shape[0], self.num_heads, self.head_dim))
        split = batch.linear_rows(mixed.device)
        if split.prefill_rows:
            self._chunked_rows(mixed, g, beta, slots, split, core)
        if split.decode_rows:
            self._decode(mixed, g, beta, split, slots, core)
        return core

    def _serial_all(self, mixed, g, beta, slots, batch: ForwardBatch) -> torch.Tensor:
        """Every row, prefill chunk or decode step, through one token-by-token conv and
        recurrence (kernels/batch_invariant.py), in place on the pool; the state is
        rounded to the pool's dtype once a step (every token in the deterministic mode)."""
        cu, slots, has_state = serial_rows(batch, slots, mixed.device)
        x = self.serial_conv(mixed, cu, slots, has_state)
        q, k, v = self._split_heads(x)
        out = bi.serial_kda(
            q, k, v, g, beta, self.recurrent_state, cu, slots, has_state, use_qk_l2norm=True,
            round_every_token=batch_invariant(),
        )  # fmt: skip
        return out.to(mixed.dtype)

    def _decode_all(self, mixed, g, beta, slots: torch.Tensor) -> torch.Tensor:
        """Every token is its row's one-token decode: the single-step kernels over all rows
        with no host sync, so CUDA graphs capture it (`resume_token_by_token` calls it once
        per token). Padding rows carry slot -1: their state is never read or written."""
        q, k, v = self._conv_update(mixed, slots)
        out = recurrent_kda(q, k, v, g, beta, self.recurrent_state, slots, use_qk_l2norm=True)
        return out.to(mixed.dtype)

    def _conv_update(self, mixed, slots: torch.Tensor):
        x = causal_conv1d_update(
            mixed, self.conv1d.weight, None, self.conv_state, slots, self.activation
        )
        return self._split_heads(x)

    def _decode_normed(self, mixed, raw_gate, beta_logits, gate, slots: torch.Tensor):
        """`batch.decode_only`: as `_decode_all` with the gates before and the output norm
        after, on CUDA in kda_decode_step (one launch where a value head fits a program,
        else the norm a second launch: Kimi-Linear's 128 x 128 heads). Returns the normed
        output [T, H, D]."""
        q, k, v = self._conv_update(mixed, slots)
        norm = self.o_norm
        return kda_decode_step(
            q, k, v, raw_gate, self.A_log, self.dt_bias, beta_logits, self.recurrent_state,
            slots, gate, norm.weight, norm.eps,
        )  # fmt: skip

    def _split_heads(self, mixed: torch.Tensor):
        q, k, v = mixed.split([self.local_width] * 3, dim=-1)
        shape = (mixed.shape[0], self.num_heads, self.head_dim)
        return q.reshape(shape), k.reshape(shape), v.reshape(shape)

    def _chunked_rows(self, mixed, g, beta, slots, split: LinearRows, core) -> None:
        """Chunked kernels over the prefill rows' tokens, from zeros for fresh rows."""
        tokens = split.prefill_tokens
        cu_seqlens = split.cu_seqlens  # on the host: the kernels read it as a list
        has_state = split.has_initial_state
        row_slots = slots.index_select(0, split.prefill_rows_index).long()

        x, conv_state = causal_conv1d_varlen(
            mixed[tokens],
            self.conv1d.weight,
            None,
            split.cu_seqlens_device,
            self.conv_state[row_slots],
            has_state,
            self.activation,
        )
        self.conv_state[row_slots] = conv_state
        q, k, v = self._split_heads(x)
        out, state = chunk_kda(
            q,
            k,
            v,
            g[tokens],
            beta[tokens],
            cu_seqlens,
            self.recurrent_state[row_slots],
            has_state,
            use_qk_l2norm=True,
            cu_seqlens_device=split.cu_seqlens_device,
        )
        self.recurrent_state[row_slots] = state.to(self.recurrent_state.dtype)
        core[tokens] = out.to(core.dtype)

    def _decode(self, mixed, g, beta, split: LinearRows, slots, core) -> None:
        """Single-step kernels, in place on the pools at the rows' own slots."""
        tokens = split.decode_tokens
        row_slots = slots.index_select(0, split.decode_rows_index)
        x = causal_conv1d_update(
            mixed[tokens], self.conv1d.weight, None, self.conv_state, row_slots, self.activation
        )
        q, k, v = self._split_heads(x)
        out = recurrent_kda(
            q, k, v, g[tokens], beta[tokens], self.recurrent_state, row_slots, use_qk_l2norm=True
        )
        core[tokens] = out.to(core.dtype)
