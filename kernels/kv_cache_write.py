"""Writes new keys and values into the paged cache: the pure-torch reference.

An FP8 cache (`kv_cache_dtype="fp8"`: float8_e4m3fn) stores each value divided by its
layer's per-tensor scale (k_scale for keys, v_scale for values), saturated to the largest
finite e4m3 value (448) as vLLM's cache writes do, and rounded to nearest even; NaN stays
NaN. Readers multiply the scale back (`dequantize_kv`). Any other cache dtype is a plain
cast and the scales are unused.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def check_scale(name: str, scale: float) -> None:
    """A per-tensor cache scale is a positive finite number."""
    ok = isinstance(scale, int | float) and not isinstance(scale, bool)
    if not (ok and 0.0 < scale < float("inf")):
        raise ValueError(f"{name}: expected a positive finite float, got {scale!r}")


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as the cache stores it: FP8 as clamp(x * (1 / scale)) in float32 (the Triton
    write kernel computes exactly this), other dtypes a plain cast."""
    if not is_fp8(dtype):
        return x.to(dtype)
    scaled = x.to(torch.float32) * (1.0 / scale)
    # clamp keeps NaN (a stale read upstream stays visible under the sanitizer).
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize_kv(cached: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cache entries back in `dtype`: FP8 entries times their scale."""
    if not is_fp8(cached.dtype):
        return cached.to(dtype)
    return cached.to(dtype) * scale


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """key/value: [T, Hkv, D]; slot = block * block_size + offset; slot < 0 is padding."""
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = quantize_kv(key[valid], kv_cache.dtype, k_scale)
    kv_cache[1, blocks, offsets] = quantize_kv(value[valid], kv_cache.dtype, v_scale)
