"""Kimi Delta Attention gates g and beta in one launch: the Triton kernel.

Same semantics as `kda_gates.kda_gates_ref` (read it for the formulas). Unfused, a KDA layer
spends 6 launches here in float32 and 9 in half precision (three casts, add, exp, negate,
softplus, multiply, sigmoid); this kernel reads raw_gate and the strided beta_logits view in
place and writes g and beta.

Grid: (token blocks, heads); a program covers BLOCK_T tokens x the head's Dk channels of g
and the same tokens' beta for its head, so a one-token decode step still spreads over H
programs. Elementwise: the block size changes no result.

Rounding follows the reference: raw + dt_bias is summed in float32 and rounded; g is the
float32 product of -exp(A_log) and softplus; beta = 1 / (1 + exp(-x)) in float32, rounded
once to beta_logits' dtype. The exp and softplus are Gated DeltaNet's (`gdn_gates_triton`:
within a few float32 ulps of torch's, threshold 20 included), compiled likewise without
fused multiply-adds and with a correctly rounded division.

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
from kvloom.kernels.gdn_gates_triton import exp_f32, softplus_f32
from kvloom.kernels.kda_gates import check_kda_gates_args

BLOCK_ELEMENTS = 1024  # tokens x channels of g per program


@triton.jit
def kda_gate_values(raw, dt_bias, a_log, logits):
    """float32 g = -exp(A_log) * softplus(raw + dt_bias) and beta = sigmoid(logits) before
    its rounding: the one formula of this kernel and of the fused KDA decode step
    (gated_delta_rule_triton.kda_decode_triton), so both give the same bits."""
    g = -exp_f32(a_log) * softplus_f32(raw + dt_bias)
    beta = tl.math.div_rn(tl.full(logits.shape, 1.0, tl.float32), 1.0 + exp_f32(-logits))
    return g, beta


# Tokens change every step: no recompiles for their value (1, multiples of 16).
@triton.jit(do_not_specialize=["num_tokens"])
def _kda_gates_kernel(
    raw_ptr,
    a_log_ptr,
    dt_bias_ptr,
    logits_ptr,
    g_ptr,
    beta_ptr,
    num_tokens,
    head_k,
    stride_raw_t,
    stride_raw_h,
    stride_logits,
    stride_g_t,
    stride_g_h,
    stride_beta,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    head = tl.program_id(1)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    channels = tl.arange(0, BLOCK_K)
    token_ok = tokens < num_tokens
    channel_ok = channels < head_k
    mask = token_ok[:, None] & channel_ok[None, :]
    rows = tokens.to(tl.int64)

    raw_ptrs = raw_ptr + rows[:, None] * stride_raw_t + head * stride_raw_h + channels[None, :]
    raw = tl.load(raw_ptrs, mask=mask, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + head * head_k + channels, mask=channel_ok, other=0.0)
    a_log = tl.load(a_log_ptr + head).to(tl.float32)
    logits = tl.load(logits_ptr + rows * stride_logits + head, mask=token_ok, other=0.0)
    logits = logits.to(tl.float32)
    g, beta = kda_gate_values(raw, dt_bias.to(tl.float32)[None, :], a_log, logits)
    g_ptrs = g_ptr + rows[:, None] * stride_g_t + head * stride_g_h + channels[None, :]
    tl.store(g_ptrs, g, mask=mask)

    beta_out = beta.to(beta_ptr.dtype.element_ty)
    tl.store(beta_ptr + rows * stride_beta + head, beta_out, mask=token_ok)


def kda_gates_triton(
    raw_gate: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, beta_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """raw_gate [T, H, Dk], A_log [H], dt_bias [H * Dk], beta_logits [T, H] (any strides
    with the last dim contiguous) -> (g [T, H, Dk] float32, beta [T, H] in beta_logits'
    dtype), both contiguous."""
    num_tokens, heads, head_k = check_kda_gates_args(raw_gate, A_log, dt_bias, beta_logits)
    named = (("raw_gate", raw_gate), ("A_log", A_log), ("dt_bias", dt_bias))
    for name, tensor in (*named, ("beta_logits", beta_logits)):
        check_dtype(name, tensor)
        check_last_dim_contiguous(name, tensor)
    check_same_device(raw_gate=raw_gate, A_log=A_log, dt_bias=dt_bias, beta_logits=beta_logits)
    device = raw_gate.device
    g = torch.empty((num_tokens, heads, head_k), dtype=torch.float32, device=device)
    beta = torch.empty((num_tokens, heads), dtype=beta_logits.dtype, device=device)
    if num_tokens == 0 or heads == 0:
        return g, beta
    block_k = next_power_of_2(head_k)
    block_t = max(1, min(BLOCK_ELEMENTS // block_k, next_power_of_2(num_tokens)))
    _kda_gates_kernel[(triton.cdiv(num_tokens, block_t), heads)](
        raw_gate,
        A_log,
        dt_bias,
        beta_logits,
        g,
        beta,
        num_tokens,
        head_k,
        raw_gate.stride(0),
        raw_gate.stride(1),
        beta_logits.stride(0),
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        BLOCK_T=block_t,
        BLOCK_K=block_k,
        num_warps=4 if block_t * block_k >= 1024 else 1,
        enable_fp_fusion=False,  # round as torch does: no fused multiply-adds
    )
    return g, beta
