"""RMSNorm, optionally fused with the residual add: the Triton kernel.

Same semantics as `rms_norm.rms_norm_ref`, rounding step by step as the reference does:
the residual sum is rounded to the input dtype, the norm runs in float32, the normalised
value is rounded to the input dtype before the weight multiplies (weight_offset = 0), or
the (offset + weight) factor multiplies in float32 first (weight_offset != 0). Only the
mean of squares and the reciprocal square root may differ from torch in the last bits.

One program normalises one row. The outputs may alias the inputs (in-place use:
`out=x, residual_out=residual`): a program reads its whole row before writing it.

The mean of squares is summed in a fixed order that depends on the row length only, never
on the layout or num_warps (`rms_row_rstd`), and the elementwise steps are shared jit
helpers (`rms_sum`, `rms_scale`): gemv_triton's fused norm prologue calls the same three,
so RMSNorm fused into a GEMV feeds the dot bitwise what this kernel stores.
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
from kvloom.kernels.pdl_triton import pdl_launch, pdl_release_then_wait, uses_pdl

MAX_HIDDEN = 65536  # one program holds a whole row in registers


SQ_LANES_MAX = 1024  # most lanes of the sum of squares (its order: rms_row_rstd)


def sq_lanes(n: int) -> int:
    """Lanes of a row's sum of squares for rows of n elements (a function of n only)."""
    return min(SQ_LANES_MAX, next_power_of_2(max(n, 1)))


@triton.jit
def _half_sum(v, HALF: tl.constexpr):
    """[2 * HALF] -> [HALF]: element i becomes elements 2i + (2i + 1): one float32 add (so
    the same bits whichever operand comes first). A sum over the pair axis, not
    tl.split + add: inside the GEMV with the norm prologue (sm_90, Triton 3.6) the split
    form took the kernel from 60 to 255 registers and spilled; this one keeps it at 64."""
    return tl.sum(tl.reshape(v, [HALF, 2]), axis=1)


@triton.jit
def _pairwise_sum(v, LANES: tl.constexpr):
    """Adds LANES (a power of 2 up to 1024) float32 values in a fixed pairwise order."""
    if LANES >= 1024:
        v = _half_sum(v, 512)
    if LANES >= 512:
        v = _half_sum(v, 256)
    if LANES >= 256:
        v = _half_sum(v, 128)
    if LANES >= 128:
        v = _half_sum(v, 64)
    if LANES >= 64:
        v = _half_sum(v, 32)
    if LANES >= 32:
        v = _half_sum(v, 16)
    if LANES >= 16:
        v = _half_sum(v, 8)
    if LANES >= 8:
        v = _half_sum(v, 4)
    if LANES >= 4:
        v = _half_sum(v, 2)
    if LANES >= 2:
        v = _half_sum(v, 1)
    return tl.sum(v, axis=0)  # the one element left


@triton.jit
def rms_sum(x, res, HAS_RESIDUAL: tl.constexpr, DTYPE: tl.constexpr):
    """x + residual rounded to DTYPE, as `x + residual` does in torch (x alone without)."""
    if HAS_RESIDUAL:
        s = (x.to(tl.float32) + res.to(tl.float32)).to(DTYPE)
    else:
        s = x.to(DTYPE)
    return s


@triton.jit
def rms_row_rstd(
    x_row,
    res_row,
    eps,
    N: tl.constexpr,
    LANES: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """1 / sqrt(mean(s * s) + eps) of one row of N elements, s = rms_sum(x, residual).

    The order is fixed by N alone (LANES = sq_lanes(N)): lane j adds the squares of
    columns j, j + LANES, ... in increasing order, a fused multiply-add each, then the
    LANES lane sums are added pairwise. Every kernel calling this gets the same bits
    for a row, whatever its num_warps or layout (tl.sum's order depends on both)."""
    acc = tl.zeros([LANES], dtype=tl.float32)
    for step in tl.static_range((N + LANES - 1) // LANES):
        cols = step * LANES + tl.arange(0, LANES)
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0)
        res = x
        if HAS_RESIDUAL:
            res = tl.load(res_row + cols, mask=mask, other=0.0)
        s = rms_sum(x, res, HAS_RESIDUAL, DTYPE).to(tl.float32)
        acc = tl.fma(s, s, acc)
    mean_sq = _pairwise_sum(acc, LANES) / N
    return tl.rsqrt(mean_sq + eps)


@triton.jit
def rms_scale(s, w, rstd, weight_offset, HAS_OFFSET: tl.constexpr, DTYPE: tl.constexpr):
    """The normalised value (float32, before the output's rounding) of row values s
    (DTYPE): rounded to DTYPE before the weight multiplies, or (HAS_OFFSET) times the
    (offset + weight) factor in float32."""
    h = s.to(tl.float32) * rstd
    w = w.to(tl.float32)
    if HAS_OFFSET:
        out = h * (weight_offset + w)
    else:
        out = w * h.to(DTYPE).to(tl.float32)
    return out


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    out32_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    stride_out32,
    eps,
    weight_offset,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SQ_LANES: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_OUT32: tl.constexpr = False,
    GDC: tl.constexpr = 0,
):
    # GDC (kernels/pdl_triton.py): the next launch (a GEMV) stages and prefetches its
    # weight while this one runs; this one waits for the launch before it first.
    pdl_release_then_wait(GDC)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    dtype = x_ptr.dtype.element_ty  # the sum's: a mixed-dtype x is converted first
    x_row = x_ptr + row * stride_x
    res_row = res_ptr + row * stride_res
    # Reads the whole row before anything is written (in-place use).
    rstd = rms_row_rstd(x_row, res_row, eps, N, SQ_LANES, HAS_RESIDUAL, dtype)
    x = tl.load(x_row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_row + cols, mask=mask, other=0.0)
        # Round the sum to the residual output's dtype, as `x + residual` does in torch.
        x = rms_sum(x, res, HAS_RESIDUAL, dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = rms_scale(x, w, rstd, weight_offset, HAS_OFFSET, dtype)
    out = out.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)
    if HAS_OUT32:  # the stored values again, widened exactly (a float32 reader's copy)
        tl.store(out32_ptr + row * stride_out32 + cols, out.to(tl.float32), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    weight_offset: float = 0.0,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    out_float32: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (norm(x + residual) * (weight_offset + weight), x + residual or None).

    `out` / `residual_out` may be given (for example `x` and `residual` for in-place use);
    they must have the shapes and dtypes the reference would return. `out_float32`, a
    float32 tensor of x's shape, also receives out's values widened (`out.float()`, in
    the same launch: for a float32 reader such as Kimi-Linear's router).
    """
    hidden = x.shape[-1] if x.dim() else 0
    if x.dim() == 0 or weight.shape != (hidden,):
        raise ValueError(
            f"weight: expected shape ({hidden},) matching x's last dim, got {tuple(weight.shape)}"
        )
    if hidden > MAX_HIDDEN:
        raise ValueError(f"x: hidden size {hidden} exceeds the kernel's limit {MAX_HIDDEN}")
    check_dtype("x", x)
    check_dtype("weight", weight)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(
                f"residual: expected shape {tuple(x.shape)}, got {tuple(residual.shape)}"
            )
        check_dtype("residual", residual)
    check_same_device(
        x=x,
        weight=weight,
        residual=residual,
        out=out,
        residual_out=residual_out,
        out_float32=out_float32,
    )
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = sum_dtype if weight_offset else torch.promote_types(weight.dtype, sum_dtype)

    x2 = _rows(x, "x")
    res2 = _rows(residual, "residual") if residual is not None else None
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    _check_output("out", out, x.shape, out_dtype)
    out2 = _rows(out, "out")
    if residual is not None:
        if residual_out is None:
            residual_out = torch.empty(x.shape, dtype=sum_dtype, device=x.device)
        _check_output("residual_out", residual_out, x.shape, sum_dtype)
        res_out2 = _rows(residual_out, "residual_out")
    elif residual_out is not None:
        raise ValueError("residual_out: given without residual")
    else:
        res_out2 = out2  # unused by the kernel
    out32 = out2  # unused by the kernel without out_float32
    if out_float32 is not None:
        _check_output("out_float32", out_float32, x.shape, torch.float32)
        out32 = _rows(out_float32, "out_float32")

    if x2.shape[0] and hidden:
        # The kernel normalises in the sum's dtype: a mixed-dtype residual is summed
        # into that dtype first.
        if residual is not None and x2.dtype != sum_dtype:
            x2 = x2.to(sum_dtype)
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            res2 if res2 is not None else x2,
            weight,
            out2,
            res_out2,
            out32,
            x2.stride(0),
            res2.stride(0) if res2 is not None else 0,
            out2.stride(0),
            res_out2.stride(0),
            out32.stride(0),
            float(eps),
            float(weight_offset),
            N=hidden,
            BLOCK_N=next_power_of_2(hidden),
            SQ_LANES=sq_lanes(hidden),
            HAS_RESIDUAL=residual is not None,
            HAS_OFFSET=bool(weight_offset),
            HAS_OUT32=out_float32 is not None,
            num_warps=_num_warps(hidden),
            enable_fp_fusion=False,  # round as torch does: no fused multiply-adds
            **pdl_launch(uses_pdl(x2)),
        )
    return out, residual_out


def _num_warps(hidden: int) -> int:
    return min(16, max(1, next_power_of_2(hidden) // 512))


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """A [rows, hidden] view with contiguous rows; copies only when no such view exists."""
    check_last_dim_contiguous(name, t)
    flat = t.reshape(-1, t.shape[-1])
    if flat.shape[-1] > 1 and flat.stride(-1) != 1:
        flat = flat.contiguous()
    return flat


def _check_output(name: str, t: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> None:
    if t.shape != shape or t.dtype != dtype:
        raise ValueError(
            f"{name}: expected {dtype} of shape {tuple(shape)}, got {t.dtype} {tuple(t.shape)}"
        )
    if not _is_row_view(t):
        raise ValueError(f"{name}: must be viewable as [rows, hidden] with contiguous rows")


def _is_row_view(t: torch.Tensor) -> bool:
    try:
        flat = t.view(-1, t.shape[-1])
    except RuntimeError:
        return False
    return flat.shape[-1] <= 1 or flat.stride(-1) == 1
