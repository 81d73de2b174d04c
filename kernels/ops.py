"""The kernels model code calls: Triton on CUDA (half/single precision), else the torch
reference with the same semantics (`dispatch.use_triton`). Triton modules are imported only
when chosen, so CPU-only installs never import triton."""

from __future__ import annotations

import torch

from kvloom.kernels.activation import silu_and_mul_ref
from kvloom.kernels.dispatch import use_triton
from kvloom.kernels.kv_cache_write import write_kv_cache_ref
from kvloom.kernels.paged_attention import paged_attention_ref
from kvloom.kernels.rms_norm import rms_norm_ref
from kvloom.kernels.rotary import apply_rotary_ref


def rms_norm(x, weight, eps, residual=None, weight_offset: float = 0.0):
    if use_triton(x):
        from kvloom.kernels.rms_norm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual, weight_offset)
    return rms_norm_ref(x, weight, eps, residual, weight_offset)


def apply_rotary(x, cos, sin, rotary_dim=None):
    if use_triton(x):
        from kvloom.kernels.rotary_triton import apply_rotary_triton

        return apply_rotary_triton(x, cos, sin, rotary_dim)
    return apply_rotary_ref(x, cos, sin, rotary_dim)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        from kvloom.kernels.activation_triton import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)


def write_kv_cache(key, value, kv_cache, slot_mapping) -> None:
    if use_triton(key) and key.dtype == kv_cache.dtype:
        from kvloom.kernels.kv_cache_write_triton import write_kv_cache_triton

        return write_kv_cache_triton(key, value, kv_cache, slot_mapping)
    return write_kv_cache_ref(key, value, kv_cache, slot_mapping)


def paged_attention(
    q,
    kv_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    scale,
    sliding_window=None,
    kv_stride: int = 1,
    kv_offset: int = 0,
):
    """The Triton kernel covers the whole cache (kv_stride 1); a DCP shard uses the reference."""
    if use_triton(q) and kv_stride == 1 and q.dtype == kv_cache.dtype:
        from kvloom.kernels.paged_attention_triton import paged_attention_triton

        return paged_attention_triton(
            q, kv_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window
        )
    return paged_attention_ref(
        q,
        kv_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        sliding_window,
        kv_stride=kv_stride,
        kv_offset=kv_offset,
    )
