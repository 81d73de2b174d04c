"""Routed mixture-of-experts: the pure-torch reference of the fused kernel.

out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t]))
with e = topk_ids[t, j], the same sum as `workers.layers.moe.FusedMoE.forward`.

Rounding points (the Triton kernel in `fused_moe_triton` has the same ones, so the two
agree to float32 summation order): both projections accumulate in float32 (float64 for
float64 inputs); silu(gate) * up is formed in that precision and rounded once to the
hidden dtype, as a half-precision model holds its activation; the down projection times
the routing weight stays in float32, and the k contributions of a token are added in
float32 in slot order j = 0..k-1 before one final rounding to the hidden dtype.

The layer's loop rounds differently in half precision (each projection's output is
rounded), so in bfloat16 the two differ by about one unit in the last place; in float64
they agree to rounding error (tested).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
ID_DTYPES = (torch.int32, torch.int64)


def _shape(tensor) -> list[int] | None:
    shape = getattr(tensor, "shape", None)
    return None if shape is None else list(shape)


def check_moe_args(hidden, w13, w2, topk_weights, topk_ids) -> tuple[int, int, int, int, int]:
    """Shape and dtype checks shared by the reference and the Triton path (shapes only, no
    device reads). Returns (T, H, E, I, k)."""
    tensors = dict(hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden: expected [T, H], got shape {_shape(hidden)}")
    num_tokens, hidden_size = hidden.shape
    if hidden.dtype not in FLOAT_DTYPES:
        raise ValueError(f"hidden: expected a floating dtype, got {hidden.dtype}")
    if w13.dim() != 3 or w13.shape[2] != hidden_size or w13.shape[1] % 2 or w13.shape[1] == 0:
        raise ValueError(
            f"w13: expected [E, 2 * I, {hidden_size}] with I >= 1, got shape {_shape(w13)}"
        )
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if num_experts == 0:
        raise ValueError("w13: expected at least one expert, got E = 0")
    if tuple(w2.shape) != (num_experts, hidden_size, inter):
        raise ValueError(
            f"w2: expected shape [{num_experts}, {hidden_size}, {inter}], got {_shape(w2)}"
        )
    for name, weight in (("w13", w13), ("w2", w2)):
        if weight.dtype != hidden.dtype:
            raise ValueError(f"{name}: dtype {weight.dtype} differs from hidden's {hidden.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_ids.shape[1] == 0:
        raise ValueError(
            f"topk_ids: expected [{num_tokens}, k] with k >= 1, got {_shape(topk_ids)}"
        )
    if topk_ids.dtype not in ID_DTYPES:
        raise ValueError(f"topk_ids: expected int32 or int64, got {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"topk_weights: expected shape {list(topk_ids.shape)} (as topk_ids), "
            f"got {_shape(topk_weights)}"
        )
    if topk_weights.dtype not in FLOAT_DTYPES:
        raise ValueError(f"topk_weights: expected a floating dtype, got {topk_weights.dtype}")
    return num_tokens, hidden_size, num_experts, inter, topk_ids.shape[1]


def fused_moe_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """hidden [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I],
    topk_weights [T, k], topk_ids [T, k] in [0, E) -> [T, H] in hidden's dtype.

    Expert ids out of range raise ValueError here (the check reads the ids back; the
    Triton path cannot afford that and drops such routes instead)."""
    num_tokens, hidden_size, num_experts, inter, top_k = check_moe_args(
        hidden, w13, w2, topk_weights, topk_ids
    )
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_experts):
        raise ValueError(f"topk_ids: expert ids must be in [0, {num_experts})")
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    # Every route's weighted expert output, by (token, slot), then summed in slot order.
    routed = torch.zeros(num_tokens, top_k, hidden_size, dtype=acc, device=hidden.device)
    for expert in torch.unique(topk_ids).tolist():
        tokens, slots = torch.nonzero(topk_ids == expert, as_tuple=True)
        x = hidden[tokens].to(acc)
        gate_up = x @ w13[expert].to(acc).T
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        act = act.to(hidden.dtype).to(acc)  # the activation a half-precision model holds
        weight = topk_weights[tokens, slots].to(acc)
        routed[tokens, slots] = (act @ w2[expert].to(acc).T) * weight[:, None]
    out = routed[:, 0]
    for slot in range(1, top_k):
        out = out + routed[:, slot]
    return out.to(hidden.dtype)
