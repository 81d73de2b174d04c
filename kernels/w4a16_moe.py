"""W4A16 fused mixture-of-experts: the pure-torch reference.

The experts' int4 weights (`w4a16_gemm` layout, with a leading expert dim:
w13_packed [E, 2I, H / 8], w13_scale [E, 2I, H / g], w2_packed [E, H, I / 8],
w2_scale [E, H, I / g]) are dequantized to the hidden dtype, rounded once as the
Triton kernel rounds them in its tiles, and the float MoE reference runs on them: the
same routing sum, activation rounding and slot order as `fused_moe.fused_moe_ref`.
"""

from __future__ import annotations

from kvloom.kernels.fused_moe import fused_moe_ref
from kvloom.kernels.w4a16_gemm import PACK_FACTOR, check_w4_args, dequantize_w4


def check_w4a16_moe_args(hidden, w13_packed, w13_scale, w2_packed, w2_scale, group_size):
    """Shapes of the packed stacks; returns (E, I)."""
    hidden_size = hidden.shape[-1]
    if w13_packed.dim() != 3 or w2_packed.dim() != 3:
        raise ValueError("w13_packed and w2_packed: expected [E, rows, cols / 8] stacks")
    check_w4_args(w13_packed, w13_scale, hidden_size, group_size)
    inter = w2_packed.shape[-1] * PACK_FACTOR
    check_w4_args(w2_packed, w2_scale, inter, group_size)
    num_experts = w13_packed.shape[0]
    if tuple(w13_packed.shape[:2]) != (num_experts, 2 * inter):
        raise ValueError(
            f"w13_packed: expected [{num_experts}, {2 * inter}, *], got {list(w13_packed.shape)}"
        )
    if tuple(w2_packed.shape[:2]) != (num_experts, hidden_size):
        raise ValueError(
            f"w2_packed: expected [{num_experts}, {hidden_size}, *], got {list(w2_packed.shape)}"
        )
    return num_experts, inter


def w4a16_fused_moe_ref(
    hidden, w13_packed, w13_scale, w2_packed, w2_scale, group_size, topk_weights, topk_ids
):
    check_w4a16_moe_args(hidden, w13_packed, w13_scale, w2_packed, w2_scale, group_size)
    w13 = dequantize_w4(w13_packed, w13_scale, group_size, hidden.dtype)
    w2 = dequantize_w4(w2_packed, w2_scale, group_size, hidden.dtype)
    return fused_moe_ref(hidden, w13, w2, topk_weights, topk_ids)
