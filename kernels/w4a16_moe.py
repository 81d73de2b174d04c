"""W4A16 fused mixture-of-experts: the pure-torch reference.

The experts' int4 weights (`w4a16_gemm` layout, with a leading expert dim:
w13_packed [E, 2I, H / 8], w13_scale [E, 2I, H / g], w2_packed [E, H, I / 8],
w2_scale [E, H, I / g]) are dequantized to the hidden dtype, rounded once as the
Triton kernel rounds them in its tiles, and the float MoE reference runs on them: the
same routing sum, activation rounding and slot order as `fused_moe.fused_moe_ref`.
"""

from __future__ import annotations

import torch

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


def check_w4a16_moe_offsets(w13_scale, w2_scale, w13_offset, w2_offset) -> bool:
    """Zero points as float32 offsets s * z shaped as the scales, both or neither;
    returns whether there are any."""
    if (w13_offset is None) != (w2_offset is None):
        raise ValueError("w13_offset and w2_offset: give both (zero points) or neither")
    if w13_offset is None:
        return False
    for name, offset, scale in (("w13_offset", w13_offset, w13_scale),
                                ("w2_offset", w2_offset, w2_scale)):  # fmt: skip
        if offset.dtype != torch.float32:
            raise ValueError(f"{name}: expected float32, got {offset.dtype}")
        if offset.shape != scale.shape or offset.stride() != scale.stride():
            raise ValueError(
                f"{name}: expected the scale's shape {list(scale.shape)} and strides "
                f"{scale.stride()}, got {list(offset.shape)} and {offset.stride()}"
            )
    return True


def w4a16_fused_moe_ref(
    hidden,
    w13_packed,
    w13_scale,
    w2_packed,
    w2_scale,
    group_size,
    topk_weights,
    topk_ids,
    *,
    w13_offset=None,
    w2_offset=None,
):
    """`w13_offset` / `w2_offset`: zero points as float32 offsets s * z (AWQ), the weight
    q * s - o, rounded once."""
    check_w4a16_moe_args(hidden, w13_packed, w13_scale, w2_packed, w2_scale, group_size)
    check_w4a16_moe_offsets(w13_scale, w2_scale, w13_offset, w2_offset)
    w13 = dequantize_w4(w13_packed, w13_scale, group_size, hidden.dtype, w13_offset)
    w2 = dequantize_w4(w2_packed, w2_scale, group_size, hidden.dtype, w2_offset)
    return fused_moe_ref(hidden, w13, w2, topk_weights, topk_ids)
