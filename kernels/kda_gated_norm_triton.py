"""KDA's output norm in one launch: the Triton kernel.

Same semantics as `kda_gated_norm.kda_gated_norm_ref` (read it for the formula); the torch
composition is about 12 launches per KDA layer at half precision (casts, pow, mean, add,
rsqrt, three multiplies, sigmoid), this kernel one.

Grid: one program per BLOCK_R rows (a row is one (token, head), normalised over D).
BLOCK_R depends on D alone, so a row's answer is the same in every launch whatever the
batch (invariant 7).

Rounding: everything in float32 as the reference, one final rounding. The sum of squares
is order-free (`gated_rms_norm_triton.sum_of_squares`), the mean and 1 / sqrt correctly
rounded (`div_rn`, `sqrt_rn`), the sigmoid 1 / (1 + exp_f32(-g)) with a correctly rounded
division, compiled without fused multiply-adds. Only the last bits of that sum, of torch's
rsqrt and of exp differ from torch, so half results equal the reference except where such
a difference flips the final rounding (by one ulp).

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
from kvloom.kernels.gated_rms_norm_triton import sum_of_squares
from kvloom.kernels.gdn_gates_triton import exp_f32
from kvloom.kernels.kda_gated_norm import check_kda_gated_norm_args

MAX_DIM = 16384  # one program holds whole rows in registers
BLOCK_ELEMENTS = 2048  # rows x padded D per program


@triton.jit
def kda_gated_norm_rows(x, gate, w, eps, D: tl.constexpr):
    """w * rmsnorm(x) * sigmoid(gate) for float32 x, gate [R, C] and w [C] (columns past D
    zero), over the first D columns -> float32 [R, C] before the final rounding."""
    mean_sq = tl.math.div_rn(sum_of_squares(x), D)
    rstd = tl.math.div_rn(tl.full(mean_sq.shape, 1.0, tl.float32), tl.math.sqrt_rn(mean_sq + eps))
    h = w[None, :] * (x * rstd[:, None])
    return h * tl.math.div_rn(tl.full(gate.shape, 1.0, tl.float32), 1.0 + exp_f32(-gate))


# Rows change with every step's token count: no recompiles for their value.
@triton.jit(do_not_specialize=["num_rows"])
def _kda_gated_norm_kernel(
    x_ptr,
    gate_ptr,
    w_ptr,
    out_ptr,
    num_rows,
    num_heads,
    stride_xt,
    stride_xh,
    stride_gt,
    stride_gh,
    eps,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    token = (rows // num_heads).to(tl.int64)  # int32 division: rows < 2**31
    head = rows % num_heads
    x_offs = token * stride_xt + head * stride_xh
    gate_offs = token * stride_gt + head * stride_gh
    x = tl.load(x_ptr + x_offs[:, None] + cols[None, :], mask=mask, other=0.0)
    gate = tl.load(gate_ptr + gate_offs[:, None] + cols[None, :], mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    out = kda_gated_norm_rows(x.to(tl.float32), gate.to(tl.float32), w, eps, D)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def block_rows(dim: int) -> int:
    """Rows per program: from D alone (invariant 7), ~BLOCK_ELEMENTS elements."""
    return max(1, min(16, BLOCK_ELEMENTS // next_power_of_2(dim)))


def kda_gated_norm_triton(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x, gate [T, H, D] (any strides with the last dim contiguous), weight [D] ->
    [T, H, D] contiguous in x's dtype."""
    tokens, heads, dim = check_kda_gated_norm_args(x, gate, weight, eps)
    for name, tensor in (("x", x), ("gate", gate), ("weight", weight)):
        check_dtype(name, tensor)
        check_last_dim_contiguous(name, tensor)
    check_same_device(x=x, gate=gate, weight=weight)
    if dim > MAX_DIM:
        raise ValueError(f"x: head dim {dim} exceeds the kernel's limit {MAX_DIM}")
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    num_rows = tokens * heads
    if num_rows == 0 or dim == 0:
        return out
    rows_per_program = block_rows(dim)
    _kda_gated_norm_kernel[(triton.cdiv(num_rows, rows_per_program),)](
        x,
        gate,
        weight,
        out,
        num_rows,
        heads,
        x.stride(0),
        x.stride(1),
        gate.stride(0),
        gate.stride(1),
        float(eps),
        D=dim,
        BLOCK_R=rows_per_program,
        BLOCK_D=next_power_of_2(dim),
        num_warps=4,
        enable_fp_fusion=False,  # round as torch does: no fused multiply-adds
    )
    return out
