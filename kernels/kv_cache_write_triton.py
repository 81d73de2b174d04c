"""Writes new keys and values into the paged cache: the Triton kernel.

Same semantics as `kv_cache_write.write_kv_cache_ref`: token t goes to slot
`slot_mapping[t] = block * block_size + offset`; a negative slot is a padding token and
writes nothing. Values are cast to the cache's dtype, so the result is bitwise the
reference's.
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
        tl.store(dst, key.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + stride_ckv, value.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key/value: [T, Hkv, D]; kv_cache: [2, num_blocks, block_size, Hkv, D]; slot < 0 skips."""
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
    check_dtype("kv_cache", kv_cache)
    check_dtype("key", key)
    check_dtype("value", value)
    check_same_device(key=key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping)
    for name, t in (("key", key), ("value", value), ("kv_cache", kv_cache)):
        check_last_dim_contiguous(name, t)
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
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=next_power_of_2(num_heads),
        DIM_PAD=next_power_of_2(head_dim),
    )
