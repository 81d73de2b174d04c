"""Writes new keys and values into the paged cache: the Triton kernel.

Same semantics as `kv_cache_write.write_kv_cache_ref`: token t goes to slot
`slot_mapping[t] = block * block_size + offset`; a negative slot is a padding token and
writes nothing. Values are cast to the cache's dtype, so the result is bitwise the
reference's. An FP8 cache (float8_e4m3fn) gets the reference's quantization: in float32,
times 1 / scale, clamped to +-448 with NaN kept, rounded to nearest even (the GPU's
`cvt.rn` conversion).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.kernels.arg_checks_triton import (
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
    next_power_of_2,
)
from kvloom.kernels.kv_cache_write import FP8_MAX, check_scale, is_fp8

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def to_cache(x, inv_scale, dtype: tl.constexpr, QUANT: tl.constexpr):
    """x as the cache stores it (kv_cache_write.quantize_kv)."""
    if QUANT:
        y = x.to(tl.float32) * inv_scale
        y = tl.maximum(y, -_FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        y = tl.minimum(y, _FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        return y.to(dtype)
    return x.to(dtype)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ckv,
    stride_cb,
    stride_co,
    stride_ch,
    block_size,
    k_inv_scale,
    v_inv_scale,
    QUANT: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        heads = tl.arange(0, HEADS_PAD)
        dims = tl.arange(0, DIM_PAD)
        mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HEAD_DIM)
        token64 = token.to(tl.int64)
        key = tl.load(
            key_ptr + token64 * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask
        )
        value = tl.load(
            value_ptr + token64 * stride_vt + heads[:, None] * stride_vh + dims[None, :],
            mask=mask,
        )
        dst = cache_ptr + block * stride_cb + offset * stride_co
        dst = dst + heads[:, None] * stride_ch + dims[None, :]
        dtype = cache_ptr.dtype.element_ty
        tl.store(dst, to_cache(key, k_inv_scale, dtype, QUANT), mask=mask)
        tl.store(dst + stride_ckv, to_cache(value, v_inv_scale, dtype, QUANT), mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """key/value: [T, Hkv, D]; kv_cache: [2, num_blocks, block_size, Hkv, D]; slot < 0 skips.
    k_scale / v_scale: the per-tensor scales of an FP8 cache (unused otherwise)."""
    quant = check_kv_write_args(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.shape[2],
        1.0 / k_scale,
        1.0 / v_scale,
        QUANT=quant,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=next_power_of_2(num_heads),
        DIM_PAD=next_power_of_2(head_dim),
    )


def check_kv_write_args(key, value, kv_cache, slot_mapping, k_scale, v_scale) -> bool:
    """Checks a cache write's arguments (this kernel's and the fused q/k norm + rotary
    kernel's epilogue); returns whether the cache is FP8 (quantized on write)."""
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key/value: expected equal shapes [T, Hkv, D], got {tuple(key.shape)} "
            f"and {tuple(value.shape)}"
        )
    num_tokens, num_heads, head_dim = key.shape
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != key.shape[1:]:
        raise ValueError(
            f"kv_cache: expected [2, num_blocks, block_size, {num_heads}, {head_dim}], "
            f"got {tuple(kv_cache.shape)}"
        )
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping: expected int32/int64 of shape ({num_tokens},), "
            f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    quant = is_fp8(kv_cache.dtype)
    if not quant:
        check_dtype("kv_cache", kv_cache)
    check_scale("k_scale", k_scale)
    check_scale("v_scale", v_scale)
    check_dtype("key", key)
    check_dtype("value", value)
    check_same_device(key=key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping)
    for name, t in (("key", key), ("value", value), ("kv_cache", kv_cache)):
        check_last_dim_contiguous(name, t)
    return quant
