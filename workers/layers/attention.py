"""Paged attention layer: writes this step's keys/values, then attends over the cache.

A layer whose q/k norm + rotary kernel also wrote the cache (RotaryEmbedding.
norm_rotate_try_cache with `cache_write(batch)`, at decode on CUDA) calls forward with
`cache_written=True`, and the separate write launch is skipped.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from kvloom.kernels.merge_attention_states import merge_attention_states_ref
from kvloom.kernels.ops import paged_attention, write_kv_cache
from kvloom.workers.attention_metadata import ForwardBatch
from kvloom.workers.cache_pages import page_view
from kvloom.workers.dtypes import TORCH_DTYPES

HALF_DTYPES = (torch.float16, torch.bfloat16)


class CacheWrite(NamedTuple):
    """Where and how a step's keys/values go into one layer's paged cache: the trailing
    arguments of kernels/ops.write_kv_cache."""

    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor  # -1: not written (padding, another DCP rank's position)
    k_scale: float
    v_scale: float


class PagedAttention(nn.Module):
    def __init__(
        self,
        layer_index: int,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: float,
        sliding_window: int | None = None,
    ):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.sliding_window = sliding_window
        # Allocated by the model runner once the pool is sized: [2, blocks, block, kv_heads, D].
        self.kv_cache: torch.Tensor | None = None
        # Per-tensor scales of an FP8 cache (kv_cache_dtype="fp8"): keys / values are
        # stored divided by them. From the checkpoint (workers/kv_cache_scales.py), else 1.
        self.k_scale = 1.0
        self.v_scale = 1.0
        # Decode context parallelism: set by the model runner to the DCP group. This rank
        # then caches positions p with p % dcp_size == dcp_rank, and the partial outputs of
        # all ranks merge exactly by their log-sum-exp.
        self.dcp = None

    supports_dcp = True

    @property
    def dcp_size(self) -> int:
        return 1 if self.dcp is None else self.dcp.world_size

    def allocate_cache(self, pages: torch.Tensor, spec) -> None:
        """Views the pool's pages as [2 (key, value), block, offset, kv head, dim]."""
        local_block_size = spec.block_size // self.dcp_size
        shape = (2, local_block_size, self.num_kv_heads, self.head_size)
        self.kv_cache = page_view(pages, TORCH_DTYPES[spec.dtype], shape).transpose(0, 1)

    def release_cache(self) -> None:
        """Drops the pages (the model runner re-allocates after its profiling run)."""
        self.kv_cache = None

    def poison_cache(self, block_ids: torch.Tensor) -> None:
        self.kv_cache[:, block_ids] = float("nan")

    def cache_write(self, batch: ForwardBatch) -> CacheWrite:
        """This step's cache write for a kernel that stores k/v itself (then call forward
        with cache_written=True). Under DCP the slots already skip other ranks' positions."""
        slots = batch.group_for(self.layer_index).slot_mapping
        return CacheWrite(self.kv_cache, slots, self.k_scale, self.v_scale)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        cache_written: bool = False,
    ) -> torch.Tensor:
        """q: [T, Hq*D], k/v: [T, Hkv*D] -> [T, Hq*D]. With `cache_written` this step's k/v
        are already in the cache (written at `cache_write(batch)`) and k, v are unused."""
        meta = batch.group_for(self.layer_index)
        q = q.view(-1, self.num_heads, self.head_size)
        if not cache_written:
            k = k.view(-1, self.num_kv_heads, self.head_size)
            v = v.view(-1, self.num_kv_heads, self.head_size)
            write_kv_cache(k, v, self.kv_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        dcp_rank = 0 if self.dcp is None else self.dcp.rank_in_group
        out_dtype = q.dtype
        if self.dcp_size > 1 and q.dtype in HALF_DTYPES:
            # Shards return float32 partials, merged then rounded once, as one rank's
            # kernel rounds once: DCP=N then matches DCP=1 to float32 rounding.
            q = q.float()
        out, lse = paged_attention(
            q,
            self.kv_cache,
            meta.block_tables,
            batch.query_start_loc,
            batch.seq_lens,
            self.scale,
            self.sliding_window,
            kv_stride=self.dcp_size,
            kv_offset=dcp_rank,
            max_query_len=1 if batch.decode_only else None,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            split_decode=batch.split_decode,  # the step's one kernel decision
        )
        if self.dcp_size > 1:
            outs = self.dcp.all_gather(out.unsqueeze(0), dim=0)
            lses = self.dcp.all_gather(lse.unsqueeze(0), dim=0)
            out, _ = merge_attention_states_ref(outs, lses)
        return out.to(out_dtype).flatten(1)
