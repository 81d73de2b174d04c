"""Gated activations: the Triton kernels for silu(gate) * up and base + sigmoid(g) * x.

Same semantics as `activation.silu_and_mul_ref`: x = [gate | up] along the last dim. As in
torch, silu is computed in float32 and rounded to x's dtype before the product, which is
rounded again; only the exponential may differ from torch's in the last float32 bit.
`gated_add_triton` is `activation.gated_add_ref` in one launch instead of three, with the
same roundings (sigmoid, product and sum each rounded to the dtype).
`mul_sigmoid_triton` is `activation.mul_sigmoid_ref` (x * sigmoid(gate), the gate read in
place from its strided [T, H, D] view) in one launch instead of three (copy, sigmoid,
multiply). It computes sigmoid as torch's CUDA kernel does, 1 / (1 + expf(-g)) in float32
with libdevice's expf and a correctly rounded division, rounded to the dtype, then the
product rounded: bitwise torch's result. The CPU interpreter has no libdevice and uses
tl.exp (numpy's float32 exp) in its place.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kvloom.kernels.arg_checks_triton import check_dtype, check_last_dim_contiguous

BLOCK = 1024


@triton.jit
def silu_mul(gate, up, DTYPE: tl.constexpr):
    """silu(gate) * up rounded to DTYPE, from float32 gate and up holding DTYPE values:
    silu rounded to DTYPE before the product, as torch's two ops round. The GEMV's fused
    epilogue (gemv_triton, GATED) calls this too, so both give the same bits; launch
    with enable_fp_fusion=False, as both do."""
    silu = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
    return (silu * up).to(DTYPE)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_out,
    N,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_out + cols, silu_mul(gate, up, x_ptr.dtype.element_ty), mask=mask
    )


def silu_and_mul_triton(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., 2N]; returns silu(x[..., :N]) * x[..., N:] of shape [..., N]."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x: last dim must be even ([gate | up]), got shape {tuple(x.shape)}")
    check_dtype("x", x)
    check_last_dim_contiguous("x", x)
    n = x.shape[-1] // 2
    out_shape = (*x.shape[:-1], n)
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != out_shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"out: expected {x.dtype} of shape {out_shape} on {x.device}, got {out.dtype} "
            f"{tuple(out.shape)} on {out.device}"
        )
    x2 = x.reshape(-1, x.shape[-1])
    try:
        out2 = out.view(-1, n)
    except RuntimeError as exc:
        raise ValueError("out: must be viewable as [rows, N]") from exc
    check_last_dim_contiguous("out", out2)
    if x2.shape[0] == 0 or n == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(n))
    grid = (x2.shape[0], triton.cdiv(n, block))
    _silu_and_mul_kernel[grid](
        x2, out2, x2.stride(0), out2.stride(0), n, BLOCK_N=block, enable_fp_fusion=False
    )
    return out


@triton.jit
def _gated_add_kernel(
    base_ptr,
    gate_ptr,
    x_ptr,
    out_ptr,
    stride_base,
    stride_gate,
    stride_x,
    stride_out,
    N,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + row * stride_gate).to(tl.float32)
    scale = (1.0 / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    base = tl.load(base_ptr + row * stride_base + cols, mask=mask, other=0.0).to(tl.float32)
    scaled = (scale * x).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (base + scaled).to(dtype), mask=mask)


def gated_add_triton(base: torch.Tensor, gate_logit: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """base, x [T, N], gate_logit [T, 1] (one dtype) -> base + sigmoid(gate_logit) * x."""
    for name, tensor in (("base", base), ("gate_logit", gate_logit), ("x", x)):
        check_dtype(name, tensor)
        if tensor.dim() != 2 or tensor.dtype != base.dtype:
            raise ValueError(f"{name}: expected a 2-D {base.dtype} tensor, got {tensor.dtype} "
                             f"{tuple(tensor.shape)}")  # fmt: skip
        check_last_dim_contiguous(name, tensor)
    rows, n = base.shape
    if tuple(x.shape) != (rows, n) or tuple(gate_logit.shape) != (rows, 1):
        raise ValueError(
            f"x [T, N] and gate_logit [T, 1] must match base {tuple(base.shape)}, got "
            f"{tuple(x.shape)} and {tuple(gate_logit.shape)}"
        )
    out = torch.empty_like(base)
    if rows == 0 or n == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(n))
    _gated_add_kernel[(rows, triton.cdiv(n, block))](
        base,
        gate_logit,
        x,
        out,
        base.stride(0),
        gate_logit.stride(0),
        x.stride(0),
        out.stride(0),
        n,
        BLOCK_N=block,
        enable_fp_fusion=False,
    )
    return out


@triton.jit
def _mul_sigmoid_kernel(
    x_ptr,
    gate_ptr,
    out_ptr,
    stride_x,
    stride_gt,
    stride_gh,
    stride_out,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, DIM_PAD)
    mask = dims < HEAD_DIM
    cols = head * HEAD_DIM + dims
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + row * stride_gt + head * stride_gh + dims, mask=mask, other=0.0)
    g = -g.to(tl.float32)
    e = libdevice.exp(g) if LIBDEVICE_EXP else tl.exp(g)
    sig = tl.math.div_rn(tl.full(e.shape, 1.0, tl.float32), 1.0 + e).to(dtype).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (x * sig).to(dtype), mask=mask)


def mul_sigmoid_triton(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [T, H * D], gate [T, H, D] (any strides with the last dim contiguous, x's dtype)
    -> x * sigmoid(gate), a new contiguous [T, H * D]."""
    check_dtype("x", x)
    check_dtype("gate", gate)
    if gate.dim() != 3 or gate.dtype != x.dtype:
        raise ValueError(f"gate: expected a 3-D {x.dtype} tensor [T, H, D], got {gate.dtype} "
                         f"{tuple(gate.shape)}")  # fmt: skip
    rows, heads, head_dim = gate.shape
    if x.dim() != 2 or tuple(x.shape) != (rows, heads * head_dim):
        raise ValueError(f"x: expected shape {(rows, heads * head_dim)}, got {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("gate", gate)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    _mul_sigmoid_kernel[(rows, heads)](
        x,
        gate,
        out,
        x.stride(0),
        gate.stride(0),
        gate.stride(1),
        out.stride(0),
        HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim),
        LIBDEVICE_EXP=os.environ.get("TRITON_INTERPRET") != "1",
        enable_fp_fusion=False,
    )
    return out
