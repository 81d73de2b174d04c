"""Rotary position embedding (neox layout, partial rotary): the Triton kernel.

Same semantics as `rotary.apply_rotary_ref`. The reference computes in x's dtype, one
rounding per torch op; this kernel rounds at the same points (each product, then the sum)
and is compiled without fused multiply-adds, so its results match the reference bitwise
(measured on an H200 in bfloat16, float16 and float32). Dims past `rotary_dim` pass
through.

One program handles one token and a block of heads; it reads both halves before writing,
so `out=x` rotates in place.
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
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_ct,
    stride_st,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_BLOCK: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
    head_mask = heads < NUM_HEADS
    dims = tl.arange(0, HALF_PAD)
    mask = head_mask[:, None] & (dims[None, :] < HALF)
    dtype = x_ptr.dtype.element_ty

    # cos/sin are cast to x's dtype first, as the reference does.
    cos = tl.load(cos_ptr + token * stride_ct + dims, mask=dims < HALF, other=0.0)
    sin = tl.load(sin_ptr + token * stride_st + dims, mask=dims < HALF, other=0.0)
    cos = cos.to(dtype).to(tl.float32)[None, :]
    sin = sin.to(dtype).to(tl.float32)[None, :]

    src = x_ptr + token * stride_xt + heads[:, None] * stride_xh + dims[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if PASS_PAD > 0:
        rest = tl.arange(0, PASS_PAD)
        rest_mask = head_mask[:, None] & (rest[None, :] < HEAD_DIM - 2 * HALF)
        rest_src = x_ptr + token * stride_xt + heads[:, None] * stride_xh + 2 * HALF
        passthrough = tl.load(rest_src + rest[None, :], mask=rest_mask)

    x1c = (x1 * cos).to(dtype).to(tl.float32)
    x2s = (x2 * sin).to(dtype).to(tl.float32)
    x2c = (x2 * cos).to(dtype).to(tl.float32)
    x1s = (x1 * sin).to(dtype).to(tl.float32)
    dst = out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(dst, (x1c - x2s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2c + x1s).to(out_ptr.dtype.element_ty), mask=mask)
    if PASS_PAD > 0:
        rest_dst = out_ptr + token * stride_ot + heads[:, None] * stride_oh + 2 * HALF
        tl.store(rest_dst + rest[None, :], passthrough, mask=rest_mask)


def apply_rotary_triton(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, rotary_dim // 2]. Returns the rotated copy (or `out`)."""
    if x.dim() != 3:
        raise ValueError(f"x: expected [T, H, D], got shape {tuple(x.shape)}")
    num_tokens, num_heads, head_dim = x.shape
    rotary_dim = rotary_dim or head_dim
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim: must be even and in (0, {head_dim}], got {rotary_dim}")
    half = rotary_dim // 2
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (num_tokens, half):
            raise ValueError(f"{name}: expected shape ({num_tokens}, {half}), got {tuple(t.shape)}")
        check_dtype(name, t)
        check_last_dim_contiguous(name, t)
    check_dtype("x", x)
    check_last_dim_contiguous("x", x)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(
            f"out: expected {x.dtype} of shape {tuple(x.shape)}, got {out.dtype} {tuple(out.shape)}"
        )
    check_last_dim_contiguous("out", out)
    check_same_device(x=x, cos=cos, sin=sin, out=out)
    if num_tokens == 0 or num_heads == 0:
        return out
    heads_block = min(next_power_of_2(num_heads), max(1, 2048 // next_power_of_2(head_dim)))
    grid = (num_tokens, triton.cdiv(num_heads, heads_block))
    _rotary_kernel[grid](
        x,
        cos,
        sin,
        out,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        cos.stride(0),
        sin.stride(0),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        HEADS_BLOCK=heads_block,
        HALF_PAD=next_power_of_2(half),
        PASS_PAD=next_power_of_2(head_dim - rotary_dim) if head_dim > rotary_dim else 0,
        enable_fp_fusion=False,  # round after every op, as torch does
    )
    return out
