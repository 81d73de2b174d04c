"""Writes new keys and values into the paged cache: the pure-torch reference."""

from __future__ import annotations

import torch


def write_kv_cache_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key/value: [T, Hkv, D]; slot = block * block_size + offset; slot < 0 is padding."""
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = key[valid].to(kv_cache.dtype)
    kv_cache[1, blocks, offsets] = value[valid].to(kv_cache.dtype)
