"""Paged attention layer: writes this step's keys/values, then attends over the cache."""

from __future__ import annotations

import torch
from torch import nn

from kvloom.kernels.kv_cache_write import write_kv_cache_ref
from kvloom.kernels.paged_attention import paged_attention_ref
from kvloom.workers.attention_metadata import ForwardBatch
from kvloom.workers.dtypes import TORCH_DTYPES


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

    def allocate_cache(self, num_blocks: int, spec, device: torch.device) -> None:
        shape = (2, num_blocks, spec.block_size, self.num_kv_heads, self.head_size)
        self.kv_cache = torch.zeros(shape, dtype=TORCH_DTYPES[spec.dtype], device=device)

    def poison_cache(self, block_ids: torch.Tensor) -> None:
        self.kv_cache[:, block_ids] = float("nan")

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [T, Hq*D], k/v: [T, Hkv*D] -> [T, Hq*D]."""
        meta = batch.group_for(self.layer_index)
        q = q.view(-1, self.num_heads, self.head_size)
        k = k.view(-1, self.num_kv_heads, self.head_size)
        v = v.view(-1, self.num_kv_heads, self.head_size)
        write_kv_cache_ref(k, v, self.kv_cache, meta.slot_mapping)
        out, _ = paged_attention_ref(
            q,
            self.kv_cache,
            meta.block_tables,
            batch.query_start_loc,
            batch.seq_lens,
            self.scale,
            self.sliding_window,
        )
        return out.flatten(1)
