"""W4A16 GEMM: the Triton kernel, dequantizing int4 weights inside the K loop.

Same semantics and rounding points as `w4a16_gemm.w4a16_linear_ref` (read its docstring):
each weight tile is unpacked from its int32 words (feature k at bits 4 * (k % 8) of word
k // 8), offset by -8, times its group's scale in float32, rounded once to the
activation dtype, and fed to a float32-accumulating dot; the output is rounded once.

The weight is read once per launch as packed int32 (a quarter of a bf16 weight's bytes),
which is what makes decode fast. Weight rows sit in the dot's M slot and tokens in its N
slot (as `fused_moe_triton` does): at decode the handful of tokens pads to 16 instead of
the 64-row MMA minimum, and every plan stays on one instruction kind. The token block
(BLOCK_M) is chosen by token count and is the only thing plans change; BLOCK_N, BLOCK_K,
warps and stages are fixed, so each output element is the same dot over the same K tiles
in the same order whatever BLOCK_M is: every plan gives bitwise the same output
(invariant 7; tested interpreted, and compiled by the gpu tests).

No host sync; it allocates only its output (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.kernels.arg_checks_triton import (
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
    is_interpreted,
)
from kvloom.kernels.fused_moe_triton import _dot
from kvloom.kernels.int4_nibbles_triton import word_nibbles
from kvloom.kernels.w4a16_gemm import check_w4_args

BLOCK_M_CHOICES = (16, 32, 64)
# Fixed for every plan (invariant 7): they decide each output element's summation order.
BLOCK_N = 64
BLOCK_K = 64
NUM_WARPS = 4
NUM_STAGES = 3


def choose_block_m(num_tokens: int) -> int:
    """Tokens per program: 16 at decode sizes, more once there are enough tokens that
    each weight tile is worth reusing across them. Shape-only (graph-safe)."""
    if num_tokens <= 16:
        return 16
    return 32 if num_tokens <= 64 else 64


@triton.jit
def dequant_w4_tile(
    w_rows,
    s_rows,
    rows_ok,
    k0,
    in_features,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    o_rows=None,
    HAS_OFFSET: tl.constexpr = False,
):
    """Columns [k0, k0 + BLOCK_K) of the rows at `w_rows` (pointers to each row's int32
    words) as a [rows, BLOCK_K] tile in OUT_DTYPE, scaled by the groups at `s_rows`, less
    (HAS_OFFSET: zero points, AWQ) the float32 group offsets s * z at `o_rows`: q * s - o
    in float32, rounded once. Each word, scale and offset is loaded once and spread over
    its 8 features / its group (in-register reshapes), not re-read per feature."""
    WORDS: tl.constexpr = BLOCK_K // 8
    word_ids = k0 // 8 + tl.arange(0, WORDS)
    w_mask = rows_ok[:, None] & (word_ids < in_features // 8)[None, :]
    words = tl.load(w_rows[:, None] + word_ids[None, :], mask=w_mask, other=0)
    nibbles = word_nibbles(words)  # [rows, WORDS, 8], each word's eight in its thread
    q = tl.reshape(nibbles, [words.shape[0], BLOCK_K]) - 8  # feature k = word * 8 + nibble
    w = q.to(tl.float32) * _group_values(s_rows, rows_ok, k0, in_features, GROUP, BLOCK_K)
    if HAS_OFFSET:
        w = w - _group_values(o_rows, rows_ok, k0, in_features, GROUP, BLOCK_K)
    return w.to(OUT_DTYPE)


@triton.jit
def _group_values(rows, rows_ok, k0, in_features, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """The per-group values at `rows` for columns [k0, k0 + BLOCK_K), float32, as
    [rows, 1] (one group spans the tile) or [rows, BLOCK_K]."""
    if GROUP >= BLOCK_K:  # the whole tile is in one group (k0 < in_features: a loop bound)
        values = tl.load(rows + k0 // GROUP, mask=rows_ok, other=0.0).to(tl.float32)[:, None]
    else:
        NG: tl.constexpr = BLOCK_K // GROUP
        g_ids = k0 // GROUP + tl.arange(0, NG)
        g_mask = rows_ok[:, None] & (g_ids < in_features // GROUP)[None, :]
        groups = tl.load(rows[:, None] + g_ids[None, :], mask=g_mask, other=0.0)
        spread = tl.broadcast_to(groups.to(tl.float32)[:, :, None], [groups.shape[0], NG, GROUP])
        values = tl.reshape(spread, [groups.shape[0], BLOCK_K])
    return values


@triton.jit(do_not_specialize=["num_tokens"])
def _w4a16_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    num_tokens,
    out_features,
    in_features,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < out_features
    tok_ok = tokens < num_tokens
    ks = tl.arange(0, BLOCK_K)
    rows64 = rows.to(tl.int64)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < in_features
        x = tl.load(
            x_ptr + tokens[:, None].to(tl.int64) * stride_xm + kk[None, :],
            mask=tok_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = dequant_w4_tile(
            w_ptr + rows64 * stride_wn,
            s_ptr + rows64 * stride_sn,
            row_ok,
            k0,
            in_features,
            GROUP,
            BLOCK_K,
            x_ptr.dtype.element_ty,
        )
        acc = _dot(w, tl.trans(x), acc, DOT_PRECISION, INTERPRETED)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + tokens[None, :].to(tl.int64) * stride_om + rows[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & tok_ok[None, :])


def w4a16_linear_triton(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    block_m: int | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N]. `block_m` (16, 32, 64) overrides the plan; every plan
    gives bitwise the same output."""
    k = x.shape[-1]
    n = check_w4_args(packed, scale, k, group_size)
    check_dtype("x", x)
    for name, tensor in (("weight_packed", packed), ("weight_scale", scale)):
        check_last_dim_contiguous(name, tensor)
    check_same_device(x=x, weight_packed=packed, weight_scale=scale, bias=bias)
    flat = x.reshape(-1, k)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    m = flat.shape[0]
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    if block_m is None:
        block_m = choose_block_m(m)
    if block_m not in BLOCK_M_CHOICES:
        raise ValueError(f"block_m: expected one of {BLOCK_M_CHOICES} or None, got {block_m!r}")
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(m, block_m))
    _w4a16_gemm_kernel[grid](
        flat,
        packed,
        scale,
        bias if bias is not None else scale,
        out,
        m,
        n,
        k,
        flat.stride(0),
        packed.stride(0),
        scale.stride(0),
        out.stride(0),
        GROUP=group_size,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        INTERPRETED=is_interpreted(_w4a16_gemm_kernel),
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out.view(*x.shape[:-1], n)
