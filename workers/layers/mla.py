"""Multi-head latent attention (MLA) as Kimi-Linear uses it: NoPE, paged latent cache.

Projections (checkpoint names): q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj when
q_lora_rank is set; kv_a_proj_with_mqa (hidden -> latent [r] + shared key part [dr]);
kv_a_layernorm (on the latent); kv_b_proj (latent -> per head [k_nope | v]); o_proj.

Kimi-Linear's MLA applies no rotary embedding (`mla_use_nope`): the "rope" dimensions of q
and of the shared key are used as projected. The cache keeps per token the normalised latent
and the shared key part (MLASpec), and attention runs in the absorbed form of
`kernels/mla_attention.py`: kv_b_proj's key half is folded into the query and its value half
applied to the latent output, so cached tokens are never decompressed.

Tensor parallelism splits heads: q_proj/q_b_proj and kv_b_proj are column-parallel by head,
o_proj row-parallel; the latent path (kv_a_proj_with_mqa, kv_a_layernorm, q_a_*) is small and
replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from kvloom.kernels.ops import mla_attention, write_mla_cache
from kvloom.workers.attention_metadata import ForwardBatch
from kvloom.workers.cache_pages import page_view
from kvloom.workers.dtypes import TORCH_DTYPES
from kvloom.workers.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from kvloom.workers.layers.norm import RMSNorm
from kvloom.workers.layers.tp_group import LocalGroup, TPGroup

# transformers builds q_a_layernorm / kv_a_layernorm without an eps: its RMSNorm default.
LATENT_NORM_EPS = 1e-6


class MultiHeadLatentAttention(nn.Module):
    def __init__(
        self,
        layer_index: int,
        hidden_size: int,
        num_heads: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_lora_rank: int,
        q_lora_rank: int | None = None,
        bias: bool = False,
        tp: TPGroup | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        tp = tp or LocalGroup()
        if num_heads % tp.world_size:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be divisible by "
                f"tensor_parallel_size ({tp.world_size})"
            )
        self.layer_index = layer_index
        self.num_heads = num_heads // tp.world_size
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.q_lora_rank = q_lora_rank
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.scale = qk_head_dim**-0.5
        if q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(
                hidden_size, [num_heads * qk_head_dim], tp=tp, dtype=dtype
            )
        else:
            self.q_a_proj = ReplicatedLinear(hidden_size, q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear(
                q_lora_rank, [num_heads * qk_head_dim], tp=tp, dtype=dtype
            )
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias, dtype=dtype
        )
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = ColumnParallelLinear(
            kv_lora_rank, [num_heads * (qk_nope_head_dim + v_head_dim)], tp=tp, dtype=dtype
        )
        self.o_proj = RowParallelLinear(
            num_heads * v_head_dim, hidden_size, bias=bias, tp=tp, dtype=dtype
        )
        # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], allocated once sized.
        self.latent_cache: torch.Tensor | None = None
        # Per-tensor scale of an FP8 latent cache (kv_cache_dtype="fp8"): the row is key
        # and value at once, so it takes the checkpoint's k_scale (as vLLM's MLA does);
        # v_scale is kept only to be reported. Set by workers/kv_cache_scales.py, else 1.
        self.k_scale = 1.0
        self.v_scale = 1.0

    # -- cache ------------------------------------------------------------------------
    def allocate_cache(self, pages: torch.Tensor, spec) -> None:
        if (spec.kv_lora_rank, spec.qk_rope_head_dim) != (
            self.kv_lora_rank,
            self.qk_rope_head_dim,
        ):
            raise ValueError(
                f"layer {self.layer_index}: MLASpec ({spec.kv_lora_rank}, "
                f"{spec.qk_rope_head_dim}) does not match the layer"
            )
        shape = (spec.block_size, self.kv_lora_rank + self.qk_rope_head_dim)
        self.latent_cache = page_view(pages, TORCH_DTYPES[spec.dtype], shape)

    def release_cache(self) -> None:
        """Drops the pages (the model runner re-allocates after its profiling run)."""
        self.latent_cache = None

    def poison_cache(self, block_ids: torch.Tensor) -> None:
        self.latent_cache[block_ids] = float("nan")

    # -- forward ----------------------------------------------------------------------
    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per local head: W_UK [H, dn, r] and W_UV [H, dv, r]."""
        w = self.kv_b_proj.weight.view(
            self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank
        )
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, projected: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden]. `projected`: kv_a_proj_with_mqa(hidden),
        computed by the caller (the decoder layer fuses its input norm into that GEMV)."""
        num_tokens = hidden.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(num_tokens, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        if projected is None:
            projected = self.kv_a_proj_with_mqa(hidden)
        latent, k_pe = projected.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)

        meta = batch.group_for(self.layer_index)
        write_mla_cache(latent, k_pe, self.latent_cache, meta.slot_mapping, self.k_scale)
        w_uk, w_uv = self.absorbed_weights()
        q_latent = torch.einsum("thd,hdr->thr", q_nope, w_uk)
        o_latent = mla_attention(
            q_latent,
            q_pe,
            self.latent_cache,
            meta.block_tables,
            batch.query_start_loc,
            batch.seq_lens,
            self.scale,
            kv_scale=self.k_scale,
        )
        out = torch.einsum("thr,hvr->thv", o_latent, w_uv)
        return self.o_proj(out.reshape(num_tokens, -1))
