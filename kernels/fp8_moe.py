"""FP8 fused mixture-of-experts: the pure-torch reference.

Expert weights are e4m3 stacks w13_q [E, 2I, H], w2_q [E, H, I] with float32 per-row
scales w13_s [E, 2I, H / g13], w2_s [E, H, I / g2] (`fp8_gemm`'s layout per expert).
The hidden states are quantized per token and g13 group once; each expert's gate/up
product is `fp8_gemm`'s group-scaled float32 sum; silu(gate) * up is rounded to the
hidden dtype (as `fused_moe_ref` rounds it), quantized per route and g2 group, and the
down product times the routing weight is summed over a token's slots in slot order in
float32, then rounded once to the hidden dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvloom.kernels.fp8_gemm import fp8_matmul_ref
from kvloom.kernels.fp8_quant import FP8_DTYPE, check_group_size, per_token_group_quant_fp8_ref


def check_fp8_moe_args(hidden, w13_q, w13_s, w2_q, w2_s, group13, group2, topk_weights, topk_ids):
    for name, w in (("w13", w13_q), ("w2", w2_q)):
        if w.dtype != FP8_DTYPE or w.dim() != 3:
            raise ValueError(f"{name}: expected a [E, rows, cols] {FP8_DTYPE} stack, got {w.dtype}")
    num_experts, two_inter, hidden_size = w13_q.shape
    inter = two_inter // 2
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size:
        raise ValueError(f"hidden: expected [T, {hidden_size}], got {list(hidden.shape)}")
    if tuple(w2_q.shape) != (num_experts, hidden_size, inter):
        raise ValueError(
            f"w2: expected shape [{num_experts}, {hidden_size}, {inter}], got {list(w2_q.shape)}"
        )
    check_group_size(group13, hidden_size, "group13")
    check_group_size(group2, inter, "group2")
    for name, s, want in (
        ("w13_scale", w13_s, (num_experts, two_inter, hidden_size // group13)),
        ("w2_scale", w2_s, (num_experts, hidden_size, inter // group2)),
    ):
        if tuple(s.shape) != want or s.dtype != torch.float32:
            raise ValueError(
                f"{name}: expected float32 {list(want)}, got {s.dtype} {list(s.shape)}"
            )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0] or topk_ids.shape[1] == 0:
        raise ValueError(f"topk_ids: expected [{hidden.shape[0]}, k], got {list(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights: expected shape {list(topk_ids.shape)}")


def fp8_fused_moe_ref(
    hidden, w13_q, w13_s, w2_q, w2_s, group13, group2, topk_weights, topk_ids
) -> torch.Tensor:
    check_fp8_moe_args(hidden, w13_q, w13_s, w2_q, w2_s, group13, group2, topk_weights, topk_ids)
    num_tokens, hidden_size = hidden.shape
    num_experts, inter, top_k = w13_q.shape[0], w13_q.shape[1] // 2, topk_ids.shape[1]
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_experts):
        raise ValueError(f"topk_ids: expert ids must be in [0, {num_experts})")
    x_q, x_s = per_token_group_quant_fp8_ref(hidden, group13)
    routed = torch.zeros(num_tokens, top_k, hidden_size, dtype=torch.float32, device=hidden.device)
    for expert in torch.unique(topk_ids).tolist():
        tokens, slots = torch.nonzero(topk_ids == expert, as_tuple=True)
        gate_up = fp8_matmul_ref(x_q[tokens], x_s[tokens], w13_q[expert], w13_s[expert], group13)
        act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(hidden.dtype)
        a_q, a_s = per_token_group_quant_fp8_ref(act, group2)
        down = fp8_matmul_ref(a_q, a_s, w2_q[expert], w2_s[expert], group2)
        routed[tokens, slots] = down * topk_weights[tokens, slots].float()[:, None]
    out = routed[:, 0]
    for slot in range(1, top_k):
        out = out + routed[:, slot]
    return out.to(hidden.dtype)
