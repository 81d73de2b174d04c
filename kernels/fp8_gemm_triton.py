"""FP8 GEMM: the Triton kernels (per-token-group activation quantization, then an e4m3
GEMM with group scales, on Hopper's FP8 tensor cores when compiled).

Semantics are `fp8_gemm.fp8_linear_ref`'s (read its docstring). Two launches:

1. `_quant_kernel`, one program per (token, group): the group's max |x| (exact), scale =
   max(amax, 1e-10) / 448, x / scale correctly rounded (`div_rn`), clamped, cast to e4m3
   (round to nearest even): bitwise the reference's quantized activations and scales.
2. `_fp8_gemm_kernel`, one program per (BLOCK_N weight rows, BLOCK_M tokens): for each
   BLOCK_K tile of K, the e4m3 dot (exact products, float32 sums) is scaled by
   x_s[t, g] * w_s[n, g] (g = the tile's group) and added to a float32 accumulator; the
   bias is added in float32 and the result rounded once.

Weight rows sit in the dot's M slot and tokens in its N slot (decode pads tokens to 16,
not to the MMA's 64). BLOCK_M is the only thing plans change (chosen by token count);
BLOCK_N, BLOCK_K, warps and stages are fixed by the shape, so every plan gives bitwise
the same output (invariant 7). A group must be whole BLOCK_K tiles, or one group per row
(per-channel weights): checked.

No host sync; allocations are the quantized activations, their scales and the output
(CUDA-graph capturable).
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
from kvloom.kernels.fp8_gemm import check_fp8_gemm_args
from kvloom.kernels.fp8_quant import FP8_DTYPE, FP8_MAX, SCALE_EPS, check_group_size
from kvloom.kernels.fused_moe_triton import _interpreted

BLOCK_M_CHOICES = (16, 32, 64)
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 3
MAX_QUANT_CHUNK = 1024


def gemm_block_k(group_size: int, in_features: int) -> int:
    """The K tile: 64 when groups are whole tiles (or one group spans the row), else the
    group itself (16 or 32). Fixed by the shape, never by the token count."""
    if group_size % 64 == 0 or group_size == in_features:
        return 64
    if group_size in (16, 32):
        return group_size
    raise ValueError(f"group_size {group_size}: expected a multiple of 64, 16, 32 or the row")


def choose_block_m(num_tokens: int) -> int:
    if num_tokens <= 16:
        return 16
    return 32 if num_tokens <= 64 else 64


@triton.jit
def _dot_fp8(a, b, acc, INTERPRETED: tl.constexpr):
    """acc + a @ b in float32 for e4m3 (or half) operands. Interpreted, an explicit sum
    over k in order (the interpreter's matmul changes its order with the shapes).
    Compiled: Triton's default for e4m3 dots on sm_90 keeps the whole K range in the
    tensor cores' narrower accumulator; max_num_imprecise_acc=0 adds every MMA's result
    into the float32 accumulator instead (DeepSeek-V3's fix for FP8 GEMM accuracy)."""
    if INTERPRETED:
        prod = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]
        return acc + tl.sum(prod, axis=1)
    return tl.dot(a, b, acc, max_num_imprecise_acc=0)


@triton.jit
def _quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    group_size,
    stride_xt,
    stride_qt,
    stride_st,
    CHUNK: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    EPS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    start = group * group_size
    offs = tl.arange(0, CHUNK)
    amax = tl.zeros([CHUNK], dtype=tl.float32)
    for c in range(0, group_size, CHUNK):
        cols = start + c + offs
        x = tl.load(x_ptr + row * stride_xt + cols, mask=(c + offs) < group_size, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    # Correctly rounded divisions (div_rn): a constexpr divisor may otherwise compile to
    # an approximate one, 1 ulp off torch's, which flips e4m3 roundings at boundaries.
    peak = tl.maximum(tl.max(amax, axis=0), EPS)
    scale = tl.math.div_rn(peak, tl.zeros_like(peak) + FP8_MAX_C)
    for c in range(0, group_size, CHUNK):
        cols = start + c + offs
        ok = (c + offs) < group_size
        x = tl.load(x_ptr + row * stride_xt + cols, mask=ok, other=0.0).to(tl.float32)
        q = tl.math.div_rn(x, tl.zeros_like(x) + scale)
        q = tl.minimum(tl.maximum(q, -FP8_MAX_C), FP8_MAX_C)
        tl.store(q_ptr + row * stride_qt + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_st + group, scale)


def per_token_group_quant_fp8_triton(x: torch.Tensor, group_size: int):
    """x [T, K] -> (x_q [T, K] e4m3, x_s [T, K / group] float32), bitwise the reference's."""
    if x.dim() != 2:
        raise ValueError(f"x: expected [T, K], got shape {list(x.shape)}")
    check_group_size(group_size, x.shape[1])
    check_last_dim_contiguous("x", x)
    t, k = x.shape
    x_q = torch.empty((t, k), dtype=FP8_DTYPE, device=x.device)
    x_s = torch.empty((t, k // group_size), dtype=torch.float32, device=x.device)
    if t == 0 or k == 0:
        return x_q, x_s
    chunk = min(MAX_QUANT_CHUNK, next_power_of_2(group_size))
    _quant_kernel[(t, k // group_size)](
        x,
        x_q,
        x_s,
        group_size,
        x.stride(0),
        x_q.stride(0),
        x_s.stride(0),
        CHUNK=chunk,
        FP8_MAX_C=FP8_MAX,
        EPS=SCALE_EPS,
    )
    return x_q, x_s


@triton.jit(do_not_specialize=["num_tokens"])
def _fp8_gemm_kernel(
    xq_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    num_tokens,
    out_features,
    in_features,
    group_size,
    stride_xq,
    stride_xs,
    stride_wn,
    stride_ws,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < out_features
    tok_ok = tokens < num_tokens
    rows64 = rows.to(tl.int64)
    tok64 = tokens.to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < in_features
        x = tl.load(
            xq_ptr + tok64[:, None] * stride_xq + kk[None, :],
            mask=tok_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + rows64[:, None] * stride_wn + kk[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        g = k0 // group_size
        x_s = tl.load(xs_ptr + tok64 * stride_xs + g, mask=tok_ok, other=0.0)
        w_s = tl.load(ws_ptr + rows64 * stride_ws + g, mask=row_ok, other=0.0)
        part = _dot_fp8(w, tl.trans(x), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), INTERPRETED)
        acc += part * w_s[:, None] * x_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + tok64[None, :] * stride_om + rows[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & tok_ok[None, :])


def fp8_matmul_triton(x_q, x_s, w_q, w_s, group_size, bias=None, out_dtype=torch.float32,
                      *, block_m: int | None = None) -> torch.Tensor:  # fmt: skip
    """[T, N] in `out_dtype` from quantized activations (x_q [T, K], x_s [T, K / g])."""
    m, k = x_q.shape
    n = w_q.shape[0]
    block_k = gemm_block_k(group_size, k)
    out = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return out
    if block_m is None:
        block_m = choose_block_m(m)
    if block_m not in BLOCK_M_CHOICES:
        raise ValueError(f"block_m: expected one of {BLOCK_M_CHOICES} or None, got {block_m!r}")
    _fp8_gemm_kernel[(triton.cdiv(n, BLOCK_N), triton.cdiv(m, block_m))](
        x_q,
        x_s,
        w_q,
        w_s,
        bias if bias is not None else w_s,
        out,
        m,
        n,
        k,
        group_size,
        x_q.stride(0),
        x_s.stride(0),
        w_q.stride(0),
        w_s.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=block_k,
        INTERPRETED=_interpreted(_fp8_gemm_kernel),
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out


def fp8_linear_triton(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    block_m: int | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N] (dynamic activation scales; a static input_scale takes the
    reference). Every `block_m` gives bitwise the same output."""
    n, k = check_fp8_gemm_args(x, w_q, w_s, group_size)
    check_dtype("x", x)
    check_last_dim_contiguous("weight", w_q)
    check_same_device(x=x, weight=w_q, weight_scale=w_s, bias=bias)
    flat = x.reshape(-1, k)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    x_q, x_s = per_token_group_quant_fp8_triton(flat, group_size)
    out = fp8_matmul_triton(
        x_q, x_s, w_q, w_s, group_size, bias, out_dtype or x.dtype, block_m=block_m
    )
    return out.view(*x.shape[:-1], n)
