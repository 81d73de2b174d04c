"""Softmax top-k MoE routing (Qwen3-MoE / Qwen3-Next): the pure-torch reference.

`softmax_topk_ref` is the semantics of `workers.layers.moe.route_softmax_topk`, which
calls it off CUDA (and for float64); `moe_router_triton.softmax_topk_triton` is the fused
kernel with the same answer.
"""

from __future__ import annotations

import torch


def check_router_args(router_logits, top_k) -> int:
    """router_logits [T, E], 1 <= top_k <= E (an int). Returns E."""
    if not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 2:
        shape = getattr(router_logits, "shape", None)
        raise ValueError(f"router_logits: expected a [tokens, experts] tensor, got {shape}")
    if not router_logits.is_floating_point():
        raise ValueError(f"router_logits: expected a floating dtype, got {router_logits.dtype}")
    num_experts = router_logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, {num_experts}], got {top_k!r}")
    return num_experts


def softmax_topk_ref(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] in the logits' dtype, ids [T, k] int64).

    Softmax over experts in float32 (float64 for float64 logits), the k largest
    probabilities sorted descending, divided by their sum when `renormalize`
    (norm_topk_prob), then cast to the logits' dtype, as transformers' Qwen3-Next router
    returns them."""
    check_router_args(router_logits, top_k)
    acc = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    probs = torch.softmax(router_logits.to(acc), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids
