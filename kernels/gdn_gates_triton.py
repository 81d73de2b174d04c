"""Gated DeltaNet gates g and beta in one launch: the Triton kernel.

Same semantics as `gdn_gates.gdn_gates_ref` (read it for the layout). Unfused, the layer
spends ~11 launches per Gated DeltaNet layer here (the copies that make b and a
contiguous, three casts, exp, negate, add, softplus, multiply, sigmoid); this kernel
reads `ba` in place and writes g and beta.

Grid: one program per BLOCK_T tokens x all value heads; elementwise, so the block size
changes no result.

Rounding follows the reference: a + dt_bias is summed in float32 and rounded; g is the
float32 product of -exp(A_log) and softplus; beta = 1 / (1 + exp(-b)) in float32, rounded
once to ba's dtype (torch's sigmoid for half inputs). Compiled without fused
multiply-adds, with correctly rounded division (`div_rn`; a plain `/` compiles to the
approximate div.full.f32) and `exp_f32` below in place of tl.exp. softplus(x) = x above
torch's threshold 20, else max(x, 0) + log1p(exp(-|x|)), with log1p(e) = 2 atanh(e / (2 + e))
summed as its odd series (e <= 1, so the ratio is <= 1/3 and 9 terms reach float32
precision): a few ulps from torch's log1p(exp(x)) for every x, with nothing but
multiplies, adds and correctly rounded divisions (no log near 1, where an approximate
float32 log would lose relative accuracy).

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
from kvloom.kernels.gdn_gates import check_gdn_gates_args

BLOCK_ELEMENTS = 1024  # tokens x heads per program
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)
LOG2E = tl.constexpr(1.4426950408889634)
# Cody-Waite split of ln 2: LN2_HI has 9 significant bits, so n * LN2_HI is exact for the
# |n| <= 127 used, and x - n * LN2_HI is exact (Sterbenz) since x is within ln2 / 2 of it.
LN2_HI = tl.constexpr(0.693359375)
LN2_LO = tl.constexpr(-2.12194440054690583e-4)


@triton.jit
def exp_f32(x):
    """exp(x) in float32 within a few ulps for every x (also used by the router and gated
    norm kernels). Compiled, tl.exp(x) is ex2.approx(x * log2e), and rounding x * log2e
    alone costs up to |x| * 2^-24 relative (~1e-6 at |x| = 20). Here x = n ln2 + r with
    integer n and |r| <= ln2 / 2, r computed almost exactly, so tl.exp only ever sees
    |r * log2e| <= 0.5; 2^n is built from its bits (n clamped to [-126, 127]: results
    over/underflow as torch's do, below 2^-126 through a subnormal product). NaN stays NaN."""
    n = tl.floor(x * LOG2E + 0.5)
    n = tl.minimum(tl.maximum(n, -126.0), 127.0)
    r = (x - n * LN2_HI) - n * LN2_LO
    scale = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.exp(r) * scale


@triton.jit
def softplus_f32(x):
    """log(1 + exp(x)) as torch.nn.functional.softplus (beta 1, threshold 20), in float32."""
    e = exp_f32(-tl.abs(x))
    s = tl.math.div_rn(e, 2.0 + e)
    s2 = s * s
    series = 1.0 / 17.0
    series = series * s2 + 1.0 / 15.0
    series = series * s2 + 1.0 / 13.0
    series = series * s2 + 1.0 / 11.0
    series = series * s2 + 1.0 / 9.0
    series = series * s2 + 1.0 / 7.0
    series = series * s2 + 1.0 / 5.0
    series = series * s2 + 1.0 / 3.0
    series = series * s2 + 1.0
    log1p_e = 2.0 * s * series
    return tl.where(x > SOFTPLUS_THRESHOLD, x, tl.maximum(x, 0.0) + log1p_e)


@triton.jit
def gdn_gate_values(b, a, a_log, dt_bias):
    """(g, beta) in float32 from float32 b, a, A_log, dt_bias of one shape: the one formula
    of this kernel and of the fused decode step (gated_delta_rule_triton.py), so both give
    the same bits when compiled alike (without fused multiply-adds)."""
    g = -exp_f32(a_log) * softplus_f32(a + dt_bias)
    beta = tl.math.div_rn(tl.full(b.shape, 1.0, tl.float32), 1.0 + exp_f32(-b))
    return g, beta


# Tokens change every step: no recompiles for their value (1, multiples of 16).
@triton.jit(do_not_specialize=["num_tokens"])
def _gdn_gates_kernel(
    ba_ptr,
    a_log_ptr,
    dt_bias_ptr,
    g_ptr,
    beta_ptr,
    num_tokens,
    num_v_heads,
    stride_ba,
    stride_g,
    stride_beta,
    GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    heads = tl.arange(0, BLOCK_H)
    head_ok = heads < num_v_heads
    mask = (tokens < num_tokens)[:, None] & head_ok[None, :]
    # Value head hv = group * r + j: b at group * 2r + j, a r columns further.
    b_cols = (heads // GROUP) * (2 * GROUP) + heads % GROUP
    rows = tokens.to(tl.int64)[:, None]
    b_ptrs = ba_ptr + rows * stride_ba + b_cols[None, :]
    b = tl.load(b_ptrs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(b_ptrs + GROUP, mask=mask, other=0.0).to(tl.float32)
    a_log = tl.load(a_log_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)
    g, beta = gdn_gate_values(b, a, a_log[None, :], dt_bias[None, :])
    tl.store(g_ptr + rows * stride_g + heads[None, :], g, mask=mask)
    beta_out = beta.to(beta_ptr.dtype.element_ty)
    tl.store(beta_ptr + rows * stride_beta + heads[None, :], beta_out, mask=mask)


def gdn_gates_triton(
    ba: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, group_v_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """ba [T, Hk * 2r] (rows may be strided, last dim contiguous), A_log [Hv], dt_bias [Hv]
    -> (g [T, Hv] float32, beta [T, Hv] in ba's dtype), both contiguous."""
    num_tokens, _, num_v_heads = check_gdn_gates_args(ba, A_log, dt_bias, group_v_heads)
    for name, tensor in (("ba", ba), ("A_log", A_log), ("dt_bias", dt_bias)):
        check_dtype(name, tensor)
    check_last_dim_contiguous("ba", ba)
    for name, tensor in (("A_log", A_log), ("dt_bias", dt_bias)):
        check_last_dim_contiguous(name, tensor)
    check_same_device(ba=ba, A_log=A_log, dt_bias=dt_bias)
    g = torch.empty((num_tokens, num_v_heads), dtype=torch.float32, device=ba.device)
    beta = torch.empty((num_tokens, num_v_heads), dtype=ba.dtype, device=ba.device)
    if num_tokens == 0:
        return g, beta
    block_h = next_power_of_2(num_v_heads)
    block_t = max(1, min(BLOCK_ELEMENTS // block_h, next_power_of_2(num_tokens)))
    _gdn_gates_kernel[(triton.cdiv(num_tokens, block_t),)](
        ba,
        A_log,
        dt_bias,
        g,
        beta,
        num_tokens,
        num_v_heads,
        ba.stride(0),
        g.stride(0),
        beta.stride(0),
        GROUP=group_v_heads,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        num_warps=4 if block_t * block_h >= 1024 else 1,
        enable_fp_fusion=False,  # round as torch does: no fused multiply-adds
    )
    return g, beta
