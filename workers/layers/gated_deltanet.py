"""Gated DeltaNet token mixer (Qwen3-Next linear-attention layers) over the state pool.

One step of the layer, per token:
  in_proj_qkvz / in_proj_ba  project the hidden state; both outputs are laid out per *key-head
                             group*: [q (Dk), k (Dk), v (r*Dv), z (r*Dv)] and [b (r), a (r)]
                             for each of the Hk key heads, r = Hv / Hk value heads per group
                             (transformers' `fix_query_key_value_ordering`).
  conv1d                     depthwise causal conv (width K, SiLU) over [all q | all k | all v]
  g, beta                    g = -exp(A_log) * softplus(a + dt_bias),  beta = sigmoid(b)
  gated delta rule           q, k L2-normalised in the kernel
  norm                       RMSNorm per value head, times silu(z)
  out_proj

Each request's live state is one page of the shared pool: conv state [C, K-1] and recurrent
state [Hv, Dk, Dv], at `state_indices`. Rows are served by the ONE classification
(`batch.rows`, invariant 1): `prefill_rows` (fresh rows, and multi-token resume rows) go to
the chunked kernels, which read a slot only where `has_initial_state`; `decode_rows` (resume
rows of one token) go to the single-step kernels, in place on the pool. A fresh row never
reads its slot, so a recycled or NaN-poisoned page cannot leak into a new request.

A step whose every row resumes its state with the same few tokens (a speculative
verification of k + 1 tokens a row, `uniform_resume_len`) runs those tokens one position
at a time through the single-step kernels instead (`resume_token_by_token`, in
linear_state_pages.py, shared with KDA): the recurrence a plain decode would compute,
with no host-side sequence bounds, so CUDA graphs can capture it.

On CUDA a mixed step of many short rows (`mixed_step_path`) also goes token by token,
through the serial kernels the deterministic mode uses (kernels/batch_invariant.py), but
rounding a narrow (bf16) state once a step rather than after every token: in
place on the pool, no state gathers and no host-side chunk bookkeeping. On the H200 that
made offline Qwen3-Next-shape throughput 34% higher at 256 requests of 128-512 prompt
tokens and 28% higher at 64 requests of 1,500-2,000 (docs/benchmarks/deterministic.md).
A few long rows keep the chunked kernels, whose work is parallel over a row's tokens.

Tensor parallelism splits key-head groups (and with them their value heads) over ranks.

A batch-1 decode step is bound by launches, so where both projections are float the layer
holds them as ONE linear `in_proj` (`FusedInputProjection`) whose output, on each rank, is
[q | k | v | z | b,a] for that rank's key-head groups: in_proj_qkvz's per-group rows are
regrouped at load time, in_proj_ba's rows appended as they are. `mixed` (the conv input),
z and ba are then column views of one GEMM's output: one launch and no cat. A quantized
checkpoint keeps the two released linears and the cat (`fuse_projections=False`; the
model decides with `gdn_fusion`). A decode-only step then runs four launches (in_proj,
conv update, `gdn_decode_step`: gates + recurrence + gated norm, out_proj) where the
separate gates, recurrence and norm took three (kernels/gated_delta_rule_triton.py).
The decoder layer's input norm joins in_proj's launch (`norm_project`), and at a
decode-only step so does the conv update (the GEMV's epilogue, kernels/gemv_triton.py):
three launches with the norm (norm + in_proj + conv, `gdn_decode_step`, out_proj).
"""

from __future__ import annotations

import torch
from torch import nn

from kvloom.contracts.kv_cache_spec import LinearStateSpec
from kvloom.kernels import batch_invariant as bi
from kvloom.kernels.dispatch import batch_invariant
from kvloom.kernels.ops import (
    causal_conv1d_update,
    causal_conv1d_varlen,
    chunk_gated_delta_rule,
    gated_rms_norm,
    gdn_decode_step,
    gdn_gates,
    recurrent_gated_delta_rule,
    rms_norm_linear_conv,
)
from kvloom.workers.attention_metadata import ForwardBatch
from kvloom.workers.layers.linear import ColumnParallelLinear, RowParallelLinear, check_shape
from kvloom.workers.layers.linear_state_pages import (
    LinearStatePages,
    mixed_step_choice,
    serial_rows,
    uniform_resume_len,
)
from kvloom.workers.layers.norm import RMSNorm
from kvloom.workers.layers.norm_linear import norm_linear
from kvloom.workers.layers.tp_group import LocalGroup, TPGroup, shard_range
from kvloom.workers.linear_rows import LinearRows
from kvloom.workers.row_kinds import RowClasses

# A split mixed step (opt-in: KVLOOM_GDN_MIXED_STEPS=split) serves rows longer than this
# with the chunked kernels (tensor cores; the chunks are 64 tokens) and the rest token by
# token. On an H200 the serial delta rule took about 9 ms a layer at a 16,384-token step
# of 834 rows (gpu_fast_path.md, fourteenth session); the split is not yet measured.
SPLIT_ROW_TOKENS = 64


def mixed_step_path(rows: RowClasses, device: torch.device) -> str:
    """How a step that is neither decode-only nor a uniform resume runs: "serial" (every
    row through the serial kernels), "split" (rows of more than SPLIT_ROW_TOKENS tokens
    through the chunked kernels, the others through the serial ones) or "chunked".
    KVLOOM_GDN_MIXED_STEPS=serial|split|chunked forces one; auto (the default) takes serial
    on CUDA for steps of at least SERIAL_MIN_ROWS rows of at most SERIAL_MAX_ROW_TOKENS
    tokens, else chunked (`serial_suits`)."""
    return mixed_step_choice("KVLOOM_GDN_MIXED_STEPS", rows, device)


class GatedRMSNorm(nn.Module):
    """out = (w * rmsnorm(x)) * silu(gate): normalise first, then gate (transformers'
    Qwen3NextRMSNormGated; its weight is plain w, not 1 + w)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), False)

    def load_shard(self, param_name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        check_shape(param_name, loaded, tuple(self.weight.shape))
        self.weight.data.copy_(loaded)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x [T, H, D]; gate [T, H, D] or a strided [T, Hk, r, D] view (one kernel)."""
        return gated_rms_norm(x, gate, self.weight, self.eps)


class ShardedDepthwiseConv(nn.Module):
    """Depthwise conv weight [C_local, K] over channels made of several parts (q, k, v),
    each split over ranks. The checkpoint holds nn.Conv1d's [C, 1, K]."""

    def __init__(self, parts: list[int], width: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.parts = list(parts)
        self.width = width
        self.ranges = [shard_range(p, tp.rank, tp.world_size, "conv channels") for p in parts]
        local = sum(end - start for start, end in self.ranges)
        self.weight = nn.Parameter(torch.empty(local, width, dtype=dtype), False)

    def load_shard(self, param_name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        if param_name != "weight":
            raise ValueError(f"unexpected parameter {param_name!r} (the conv has no bias)")
        check_shape(param_name, loaded, (sum(self.parts), 1, self.width))
        full, offset, pieces = loaded[:, 0], 0, []
        for size, (start, end) in zip(self.parts, self.ranges):
            pieces.append(full[offset + start : offset + end])
            offset += size
        self.weight.data.copy_(torch.cat(pieces))


class FusedInputProjection(ColumnParallelLinear):
    """One column-parallel linear over parts loaded from several checkpoint tensors.

    `sources[i]` = (part sizes, groups): checkpoint tensor i fills those consecutive parts.
    Its rows are `groups` equal blocks, each holding every part's share in order (groups = 1:
    the parts are stacked whole; groups = Hk: in_proj_qkvz's per-key-head [q, k, v, z]).
    Loading regroups the rows into one block per part; each part is then split over ranks
    like any ColumnParallelLinear part, so a rank's output is [part 0 | part 1 | ...] of its
    own heads. Float weights only (quantized checkpoints keep the released linears)."""

    def __init__(self, input_size, sources, tp=None, dtype=torch.float32):
        self.sources = [(list(sizes), groups) for sizes, groups in sources]
        for sizes, groups in self.sources:
            for size in sizes:
                if size % groups:
                    raise ValueError(f"part of {size} rows is not split in {groups} groups")
        super().__init__(
            input_size, [s for sizes, _ in self.sources for s in sizes], tp=tp, dtype=dtype
        )
        self.num_shards = len(self.sources)  # checkpoint tensors (weight_loader)

    def load_shard(self, param_name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        if self.quant_method is not None:
            raise ValueError(f"weight {param_name}: a fused input projection is float only")
        if not 0 <= shard < len(self.sources):
            raise ValueError(f"weight {param_name}: unexpected shard {shard}")
        sizes, groups = self.sources[shard]
        check_shape(param_name, loaded, (sum(sizes), self.input_size))
        first = sum(len(s) for s, _ in self.sources[:shard])
        blocks = loaded.unflatten(0, (groups, -1)).split([s // groups for s in sizes], dim=1)
        for part, block in enumerate(blocks):
            super().load_shard(param_name, block.flatten(0, 1), first + part)


class GatedDeltaNet(LinearStatePages, nn.Module):
    """Qwen3-Next's linear-attention layer; also a cache layer (allocate/poison/copy)."""

    # The checkpoint's input projections, in the fused linear's shard order.
    checkpoint_projections = ("in_proj_qkvz", "in_proj_ba")

    def __init__(
        self,
        config: dict,
        layer_index: int,
        tp: TPGroup | None,
        dtype: torch.dtype,
        fuse_projections: bool = True,
    ):
        super().__init__()
        tp = tp or LocalGroup()
        self.layer_index = layer_index
        self.fused = fuse_projections
        self.dtype = dtype
        hidden = config["hidden_size"]
        num_k, num_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
        if num_v % num_k:
            raise ValueError(
                f"linear_num_value_heads ({num_v}) must be a multiple of "
                f"linear_num_key_heads ({num_k})"
            )
        if num_k % tp.world_size:
            raise ValueError(
                f"linear_num_key_heads ({num_k}) must be divisible by "
                f"tensor_parallel_size ({tp.world_size})"
            )
        self.head_k_dim = config["linear_key_head_dim"]
        self.head_v_dim = config["linear_value_head_dim"]
        self.group_v_heads = num_v // num_k  # value heads per key head
        self.num_k_heads = num_k // tp.world_size  # this rank's
        self.num_v_heads = num_v // tp.world_size
        self.conv_width = config.get("linear_conv_kernel_dim", 4)
        self.activation = config.get("hidden_act", "silu")
        if self.activation not in ("silu", "swish"):
            raise ValueError(f"hidden_act must be silu for Gated DeltaNet, got {self.activation!r}")
        key_dim, value_dim = num_k * self.head_k_dim, num_v * self.head_v_dim
        self._build_projections(config, tp, dtype)
        self.conv1d = ShardedDepthwiseConv(
            [key_dim, key_dim, value_dim], self.conv_width, tp, dtype
        )
        self.conv_channels = self.conv1d.weight.shape[0]
        self.v_range = shard_range(num_v, tp.rank, tp.world_size, "linear_num_value_heads")
        self.num_v_heads_total = num_v
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype), False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype), False)
        self.norm = GatedRMSNorm(self.head_v_dim, config.get("rms_norm_eps", 1e-6), dtype)
        self.out_proj = RowParallelLinear(value_dim, hidden, tp=tp, dtype=dtype)
        # The state pool, allocated once the block pool is sized.
        self.conv_state: torch.Tensor | None = None
        self.recurrent_state: torch.Tensor | None = None

    def _build_projections(self, config: dict, tp: TPGroup, dtype: torch.dtype) -> None:
        """Fused: `in_proj` gives [q | k | v | z] of this rank's groups, then its groups'
        [b (r), a (r)] as released (`gdn_gates` reads them there, group r). Unfused: the
        released in_proj_qkvz and in_proj_ba, each one part (key-head groups are contiguous,
        so a rank's slice of the rows is exactly its groups)."""
        hidden, num_k = config["hidden_size"], config["linear_num_key_heads"]
        r, dk, dv = self.group_v_heads, self.head_k_dim, self.head_v_dim
        key_dim, value_dim, ba_dim = num_k * dk, num_k * r * dv, num_k * 2 * r
        self.ba_group = r
        if self.fused:
            sources = [([key_dim, key_dim, value_dim, value_dim], num_k), ([ba_dim], 1)]
            self.in_proj = FusedInputProjection(hidden, sources, tp=tp, dtype=dtype)
            return
        qkvz_dim = 2 * key_dim + 2 * value_dim
        self.in_proj_qkvz = ColumnParallelLinear(hidden, [qkvz_dim], tp=tp, dtype=dtype)
        self.in_proj_ba = ColumnParallelLinear(hidden, [ba_dim], tp=tp, dtype=dtype)

    # -- weights and cache ----------------------------------------------------------
    def load_shard(self, param_name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        """A_log and dt_bias: one value per value head, this rank's heads."""
        if param_name not in ("A_log", "dt_bias"):
            raise ValueError(f"unexpected parameter {param_name!r}")
        check_shape(param_name, loaded, (self.num_v_heads_total,))
        start, end = self.v_range
        getattr(self, param_name).data.copy_(loaded[start:end])

    def state_spec(self, block_size: int, dtype_name: str) -> LinearStateSpec:
        return LinearStateSpec(
            block_size,
            conv_state_shape=(self.conv_channels, self.conv_width - 1),
            recurrent_state_shape=(self.num_v_heads, self.head_k_dim, self.head_v_dim),
            dtype=dtype_name,
            state_dtype="float64" if dtype_name == "float64" else "float32",
        )

    # -- forward --------------------------------------------------------------------
    def _split_projections(self, hidden: torch.Tensor, projected: torch.Tensor | None = None):
        """-> mixed_qkv [T, C] (conv input, channels [q | k | v]), z [T, Hv, Dv] or
        [T, Hk, r, Dv], and ba (the gates' input): fused, all three are column views of one
        GEMM's output (rows strided; the conv, gates and norm kernels read them in place).
        `projected`: that output, computed by the caller (fused only)."""
        tokens = hidden.shape[0]
        if self.fused:
            z_dim = self.num_v_heads * self.head_v_dim
            out = self.in_proj(hidden) if projected is None else projected
            mixed, z, ba = out.split(
                [self.conv_channels, z_dim, out.shape[-1] - z_dim - self.conv_channels], dim=-1
            )
            return mixed, z.view(tokens, self.num_v_heads, self.head_v_dim), ba
        dk, dv, r = self.head_k_dim, self.head_v_dim, self.group_v_heads
        qkvz = self.in_proj_qkvz(hidden).view(tokens, self.num_k_heads, -1)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        mixed = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], -1)
        return mixed, z.view(tokens, self.num_k_heads, r, dv), self.in_proj_ba(hidden)

    def _gates(self, ba: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """g = -exp(A_log) * softplus(a + dt_bias) (float32), beta = sigmoid(b), one kernel
        reading b and a where the projection put them."""
        return gdn_gates(ba, self.A_log, self.dt_bias, self.ba_group)

    def _split_heads(self, mixed: torch.Tensor):
        key_dim = self.num_k_heads * self.head_k_dim
        q, k, v = mixed.split([key_dim, key_dim, self.num_v_heads * self.head_v_dim], dim=-1)
        tokens = mixed.shape[0]
        return (
            q.reshape(tokens, self.num_k_heads, self.head_k_dim),
            k.reshape(tokens, self.num_k_heads, self.head_k_dim),
            v.reshape(tokens, self.num_v_heads, self.head_v_dim),
        )

    def norm_project(
        self,
        norm: RMSNorm,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The decoder layer's input norm and in_proj (fused projections only): returns
        (projected, residual, convolved) for `forward(projected=, convolved=)`. At a
        decode-only step the conv update runs here too (`convolved`, the conv's output;
        one launch with the norm and the GEMV on CUDA: ops.rms_norm_linear_conv), else
        convolved is None and `forward` runs the conv."""
        if not (batch.decode_only and not batch_invariant()):
            projected, residual, _ = norm_linear(norm, hidden, residual, self.in_proj)
            return projected, residual, None
        slots = batch.group_for(self.layer_index).state_indices
        projected, new_residual, convolved = rms_norm_linear_conv(
            hidden, residual, norm.weight, norm.eps, self.in_proj.weight, self.in_proj.bias,
            self.conv1d.weight, self.conv_state, slots, weight_offset=norm.weight_offset,
            activation=self.activation,
        )  # fmt: skip
        return projected, hidden if residual is None else new_residual, convolved

    def forward(
        self,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        projected: torch.Tensor | None = None,
        convolved: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden [T, H] -> [T, H]; reads and writes each row's state page. `projected`
        (fused only): in_proj's output, computed by the caller (the decoder layer fuses it
        with its norm); hidden's values are then unused, only its rows, dtype and device.
        `convolved`: the decode step's conv output, computed with it (`norm_project`)."""
        mixed, z, ba = self._split_projections(hidden, projected)
        slots = batch.group_for(self.layer_index).state_indices
        if batch.decode_only and not batch_invariant():
            core = self._decode_step(mixed, z, ba, slots, convolved)
            return self.out_proj(core.flatten(1))
        if convolved is not None:
            raise ValueError("convolved: given only for a decode-only step (norm_project)")
        g, beta = self._gates(ba)
        if batch_invariant():
            core = self._serial_all(mixed, g, beta, slots, batch)
            return self.out_proj(self.norm(core, z).flatten(1))
        resume = uniform_resume_len(batch, hidden.shape[0])
        if resume is not None:
            core = self.resume_token_by_token(mixed, g, beta, slots, resume)
            return self.out_proj(self.norm(core, z).flatten(1))
        path = mixed_step_path(batch.rows, hidden.device)
        if path == "serial":
            core = self._serial_all(mixed, g, beta, slots, batch)
            return self.out_proj(self.norm(core, z).flatten(1))
        if path == "split":
            core = self._split_step(mixed, g, beta, slots, batch, SPLIT_ROW_TOKENS)
            return self.out_proj(self.norm(core, z).flatten(1))
        core = hidden.new_zeros(hidden.shape[0], self.num_v_heads, self.head_v_dim)
        split = batch.linear_rows(hidden.device)
        self._chunked_rows(mixed, g, beta, slots, split, core)
        if split.decode_rows:
            index = split.decode_tokens
            pages = self._pages(slots, split.decode_rows_index)
            x = causal_conv1d_update(
                mixed[index], self.conv1d.weight, None, self.conv_state, pages, self.activation
            )
            q, k, v = self._split_heads(x)
            core[index] = recurrent_gated_delta_rule(
                q, k, v, g[index], beta[index], self.recurrent_state, pages, use_qk_l2norm=True
            )
        normed = self.norm(core, z)
        return self.out_proj(normed.flatten(1))

    def _chunked_rows(self, mixed, g, beta, slots, rows: LinearRows, core) -> None:
        """`rows`' prefill rows through the chunked conv and delta rule (their state pages
        gathered, then written back); their outputs into core."""
        if not rows.prefill_rows:
            return
        index, cu = rows.prefill_tokens, rows.cu_seqlens
        pages = self._pages(slots, rows.prefill_rows_index)
        has_state = rows.has_initial_state
        x, conv_final = causal_conv1d_varlen(
            mixed[index], self.conv1d.weight, None, rows.cu_seqlens_device,
            self.conv_state[pages], has_state, self.activation,
        )  # fmt: skip
        self.conv_state[pages] = conv_final
        q, k, v = self._split_heads(x)
        out, final = chunk_gated_delta_rule(
            q, k, v, g[index], beta[index], cu, self.recurrent_state[pages], has_state,
            use_qk_l2norm=True, cu_seqlens_device=rows.cu_seqlens_device,
        )  # fmt: skip
        self.recurrent_state[pages] = final.to(self.recurrent_state.dtype)
        core[index] = out

    def _decode_step(self, mixed, z, ba, slots: torch.Tensor, convolved=None) -> torch.Tensor:
        """A decode-only step after the projection -> the normed output: the conv update
        (unless `norm_project` ran it: `convolved`), then gates, recurrence and norm in one
        launch on CUDA (`gdn_decode_step`). No host sync, so CUDA graphs capture it;
        padding rows carry slot -1 (never read)."""
        x = convolved
        if x is None:
            x = causal_conv1d_update(
                mixed, self.conv1d.weight, None, self.conv_state, slots, self.activation
            )
        q, k, v = self._split_heads(x)
        return gdn_decode_step(
            q, k, v, ba, self.A_log, self.dt_bias, self.ba_group, self.recurrent_state, slots,
            z, self.norm.weight, self.norm.eps,
        )  # fmt: skip

    def _decode_all(self, mixed, g, beta, slots: torch.Tensor) -> torch.Tensor:
        """Every token is its row's one-token decode, gates given (one position of
        `resume_token_by_token`): no host sync, so CUDA graphs capture it. Padding rows
        carry slot -1: their state is never read."""
        x = causal_conv1d_update(
            mixed, self.conv1d.weight, None, self.conv_state, slots, self.activation
        )
        q, k, v = self._split_heads(x)
        return recurrent_gated_delta_rule(
            q, k, v, g, beta, self.recurrent_state, slots, use_qk_l2norm=True
        )

    def _serial_all(self, mixed, g, beta, slots, batch: ForwardBatch) -> torch.Tensor:
        """Every row, prefill chunk or decode step, through one token-by-token conv and
        recurrence (kernels/batch_invariant.py), in place on the pool: the deterministic
        mode's path (a token's numbers do not depend on chunking, prefix hits or
        preemption), and the fast one for mixed steps of many short rows."""
        if slots is None:
            raise ValueError("state_indices: missing for a linear-state layer's group")
        if batch.decode_only:  # one token per row, padding rows (slot -1) included
            rows = mixed.shape[0]
            cu = torch.arange(rows + 1, dtype=torch.int32, device=mixed.device)
            has_state = torch.ones(rows, dtype=torch.bool, device=mixed.device)
        else:
            cu, slots, has_state = serial_rows(batch, slots, mixed.device)
        x = self.serial_conv(mixed, cu, slots, has_state)
        q, k, v = self._split_heads(x)
        # The deterministic mode rounds a narrow state after every token (chunking then
        # changes no bits); elsewhere once a step, as the chunked kernels do.
        return bi.serial_gated_delta_rule(
            q, k, v, g, beta, self.recurrent_state, cu, slots, has_state, use_qk_l2norm=True,
            round_every_token=batch_invariant(),
        )  # fmt: skip

    @staticmethod
    def _pages(slots: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
        """The state page of each given row (an index tensor on the device); every served
        row must own one."""
        if slots is None:
            raise ValueError("state_indices: missing for a linear-state layer's group")
        pages = slots.index_select(0, rows).to(torch.int64)
        # Checked where it is free; on CUDA the check would make the host wait (the CPU
        # suite covers the invariant).
        if not pages.is_cuda and bool((pages < 0).any()):
            raise ValueError(f"state_indices: a scheduled row has no state page ({pages.tolist()})")
        return pages
