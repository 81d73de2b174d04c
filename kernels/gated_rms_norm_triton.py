"""Gated RMSNorm per value head in one launch: the Triton kernel.

Same semantics as `gated_rms_norm.gated_rms_norm_ref` (read it for the gate's layout).
Unfused, the Gated DeltaNet layer spends ~13 launches here (the copy that makes z
contiguous, four casts, pow, mean, add, rsqrt, three multiplies, silu); this kernel reads
x and the gate where they lie (the gate as a strided view of the in_proj_qkvz output)
and writes the contiguous result.

Grid: one program per BLOCK_R rows (a row is one (token, value head), normalised over D).
BLOCK_R depends on D alone, never on the token count, so a row's answer is the same in
every launch (invariant 7).

Rounding follows the reference step by step: the mean of squares and rsqrt in float32,
the normalised row rounded to x's dtype, the weight product rounded to x's dtype when the
weight has x's dtype (torch's promotion; float32 otherwise), times silu(gate) in float32,
one final rounding; compiled without fused multiply-adds, with correctly rounded division
and square root (`div_rn`, `sqrt_rn`: a plain `/` compiles to the approximate
div.full.f32, and tl.rsqrt is not correctly rounded either) and `gdn_gates_triton.exp_f32`
for silu. The sum of squares is added in no particular order (`sum_of_squares`: fixed
point, so the fused decode step's epilogue gets the same bits). Only that sum's last bit
and the last bits of rsqrt (torch's CUDA rsqrtf is not correctly rounded) and exp differ
from torch,
so half results equal the reference except where such a last-bit difference flips a
rounding (then by about one ulp of the normalised row).

No host synchronisation: the launch is CUDA-graph capturable.
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
from kvloom.kernels.gated_rms_norm import check_gated_rms_norm_args
from kvloom.kernels.gdn_gates_triton import exp_f32

MAX_DIM = 16384  # one program holds whole rows in registers
BLOCK_ELEMENTS = 2048  # rows x padded D per program


# Fixed-point fraction bits of `sum_of_squares`: a row's squares, scaled below 4, are summed
# as integers of 2^-FRACTION_BITS; D <= MAX_DIM = 2^14 of them stay below 2^60.
FRACTION_BITS = 44
FIXED_ONE = tl.constexpr(2.0**FRACTION_BITS)
FIXED_UNIT = tl.constexpr(2.0**-FRACTION_BITS)


@triton.jit
def _pow2(n):
    """2.0 ** n for int32 n in [-126, 127], built from its bits (exact)."""
    return ((n + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def sum_of_squares(h):
    """Row sums of h * h for float32 h [R, C], the same bits whatever the kernel: a plain
    tl.sum adds in an order that follows the register layout, which differs between this
    kernel and the fused decode step's epilogue (gated_delta_rule_triton.py). Each square
    is rounded to float32 as torch rounds it, scaled by a power of two from the row's
    largest |h| (exact), cut to a multiple of 2^-FRACTION_BITS of that scale and summed as
    int64, so in any order; the sum is rounded once to float32 (within ~2^-30 of the exact
    sum: at least as close as a float32 summation). Rows with inf or NaN keep the plain
    sum (inf or NaN whatever the order)."""
    plain = tl.sum(h * h, axis=1)
    biggest = tl.max(tl.abs(h), axis=1)
    # Exponent e of the largest |h| (as -126 for zero and subnormal rows): |h| < 2^(e+1).
    e = ((biggest.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -126)
    lo = e >> 1
    hi = e - lo  # 2^e in two normal factors: e reaches 127
    scaled = h * _pow2(-lo)[:, None] * _pow2(-hi)[:, None]  # |scaled| < 2
    fixed = (scaled * scaled * FIXED_ONE).to(tl.int64)  # truncated: < 2^46
    exact = tl.sum(fixed, axis=1).to(tl.float32) * FIXED_UNIT
    exact = exact * _pow2(lo) * _pow2(hi) * _pow2(lo) * _pow2(hi)
    return tl.where(plain < float("inf"), exact, plain)


@triton.jit
def gated_rms_norm_rows(x, gate, w, eps, D: tl.constexpr, ROUND_PRODUCT: tl.constexpr):
    """(w * rmsnorm(x)) * silu(gate) for x [R, C] in its own dtype (columns past D zero),
    gate [R, C] and w [C] float32, over the first D columns -> float32 [R, C] before the
    final rounding. The one formula of this kernel and of the fused decode step."""
    h = x.to(tl.float32)
    mean_sq = tl.math.div_rn(sum_of_squares(h), D)
    # 1 / sqrt, each correctly rounded (as torch's CPU rsqrt; tl.rsqrt is not).
    rstd = tl.math.div_rn(tl.full(mean_sq.shape, 1.0, tl.float32), tl.math.sqrt_rn(mean_sq + eps))
    h = h * rstd[:, None]
    h = h.to(x.dtype).to(tl.float32)
    h = w[None, :] * h
    if ROUND_PRODUCT:
        h = h.to(x.dtype).to(tl.float32)
    gate = gate.to(tl.float32)
    return h * tl.math.div_rn(gate, 1.0 + exp_f32(-gate))


# Rows change with every step's token count: no recompiles for their value.
@triton.jit(do_not_specialize=["num_rows"])
def _gated_rms_norm_kernel(
    x_ptr,
    gate_ptr,
    w_ptr,
    out_ptr,
    num_rows,
    num_v_heads,
    stride_xt,
    stride_xh,
    stride_gt,
    stride_gk,
    stride_gj,
    eps,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    token = (rows // num_v_heads).to(tl.int64)  # int32 division: rows < 2**31
    head = rows % num_v_heads
    x_offs = token * stride_xt + head * stride_xh
    gate_offs = token * stride_gt + (head // GROUP) * stride_gk + (head % GROUP) * stride_gj

    x = tl.load(x_ptr + x_offs[:, None] + cols[None, :], mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + gate_offs[:, None] + cols[None, :], mask=mask, other=0.0)
    out = gated_rms_norm_rows(x, gate, w, eps, D, ROUND_PRODUCT)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def block_rows(dim: int) -> int:
    """Rows per program: from D alone (invariant 7), ~BLOCK_ELEMENTS elements."""
    return max(1, min(16, BLOCK_ELEMENTS // next_power_of_2(dim)))


def gated_rms_norm_triton(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x [T, Hv, D], gate [T, Hk, r, D] with Hk * r = Hv (or [T, Hv, D]), weight [D]; any
    strides with the last dim contiguous -> [T, Hv, D] contiguous in x's dtype."""
    tokens, num_v_heads, dim, group = check_gated_rms_norm_args(x, gate, weight, eps)
    for name, tensor in (("x", x), ("gate", gate), ("weight", weight)):
        check_dtype(name, tensor)
        check_last_dim_contiguous(name, tensor)
    check_same_device(x=x, gate=gate, weight=weight)
    if dim > MAX_DIM:
        raise ValueError(f"x: head dim {dim} exceeds the kernel's limit {MAX_DIM}")
    out = torch.empty((tokens, num_v_heads, dim), dtype=x.dtype, device=x.device)
    num_rows = tokens * num_v_heads
    if num_rows == 0 or dim == 0:
        return out
    if gate.dim() == 3:
        gate_strides = (gate.stride(0), gate.stride(1), 0)
    else:
        gate_strides = (gate.stride(0), gate.stride(1), gate.stride(2))
    # torch multiplies weight * normed in their promoted dtype: rounded only when that is
    # a half type, i.e. the weight has x's (half) dtype.
    round_product = torch.promote_types(weight.dtype, x.dtype) in (torch.float16, torch.bfloat16)
    rows_per_program = block_rows(dim)
    _gated_rms_norm_kernel[(triton.cdiv(num_rows, rows_per_program),)](
        x,
        gate,
        weight,
        out,
        num_rows,
        num_v_heads,
        x.stride(0),
        x.stride(1),
        *gate_strides,
        float(eps),
        D=dim,
        GROUP=group,
        BLOCK_R=rows_per_program,
        BLOCK_D=next_power_of_2(dim),
        ROUND_PRODUCT=round_product,
        num_warps=4,
        enable_fp_fusion=False,  # round as torch does: no fused multiply-adds
    )
    return out
