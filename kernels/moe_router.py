"""Softmax top-k MoE routing (Qwen3-MoE / Qwen3-Next): the pure-torch reference.

`softmax_topk_ref` is the semantics of `workers.layers.moe.route_softmax_topk`, which
calls it off CUDA (and for float64); `moe_router_triton.softmax_topk_triton` is the fused
kernel with the same answer.

A layer whose FusedMoE holds its shared expert as one more expert (id E, after the E routed
ones) asks every router for k + 1 routes (`shared_expert_weight`): the k routed ones, then
expert E with weight sigmoid(the logits' last column) ("sigmoid_last_logit": Qwen3-Next's
shared expert gate, the last row of its fused router GEMM) or 1 ("one": Kimi-Linear's
ungated shared expert). The routed choice and weights are those of the other columns alone.
"""

from __future__ import annotations

import torch

# Most experts the router kernels hold in registers (one program a token's whole row of
# logits and keys; moe_router_triton); wider routers take the reference.
ROUTER_KERNEL_MAX_EXPERTS = 8192
# How a router weighs the shared expert it appends as route k (None: no shared route).
SHARED_EXPERT_WEIGHTS = (None, "sigmoid_last_logit", "one")


def check_router_args(router_logits, top_k, shared_expert_weight=None) -> int:
    """router_logits [T, E] (E + 1 columns with "sigmoid_last_logit"), 1 <= top_k <= E
    (an int), shared_expert_weight in SHARED_EXPERT_WEIGHTS. Returns E, the routed experts
    (also the shared expert's id)."""
    if shared_expert_weight not in SHARED_EXPERT_WEIGHTS:
        raise ValueError(
            f"shared_expert_weight must be one of {SHARED_EXPERT_WEIGHTS}, "
            f"got {shared_expert_weight!r}"
        )
    if not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 2:
        shape = getattr(router_logits, "shape", None)
        raise ValueError(f"router_logits: expected a [tokens, experts] tensor, got {shape}")
    if not router_logits.is_floating_point():
        raise ValueError(f"router_logits: expected a floating dtype, got {router_logits.dtype}")
    num_experts = router_logits.shape[1] - (shared_expert_weight == "sigmoid_last_logit")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, {num_experts}], got {top_k!r}")
    return num_experts


def append_shared_route(
    weights: torch.Tensor,
    ids: torch.Tensor,
    router_logits: torch.Tensor,
    shared_expert_weight: str | None,
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed (weights [T, k], ids [T, k]) with the shared expert's route appended as
    column k: id `num_experts`, weight sigmoid(last logit) (computed in float32, or float64
    for float64 logits, then cast to the weights' dtype, as torch's sigmoid of a half
    tensor rounds) or 1. Unchanged for None."""
    if shared_expert_weight is None:
        return weights, ids
    if shared_expert_weight == "sigmoid_last_logit":
        acc = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
        shared = torch.sigmoid(router_logits[:, num_experts:].to(acc)).to(weights.dtype)
    else:
        shared = torch.ones_like(weights[:, :1])
    shared_id = torch.full_like(ids[:, :1], num_experts)
    return torch.cat([weights, shared], dim=1), torch.cat([ids, shared_id], dim=1)


def softmax_topk_ref(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    shared_expert_weight: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] in the logits' dtype, ids [T, k] int64);
    [T, k + 1] with a shared route (`append_shared_route`; the module docstring).

    Softmax over experts in float32 (float64 for float64 logits), the k largest
    probabilities sorted descending, divided by their sum when `renormalize`
    (norm_topk_prob), then cast to the logits' dtype, as transformers' Qwen3-Next router
    returns them."""
    num_experts = check_router_args(router_logits, top_k, shared_expert_weight)
    acc = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    probs = torch.softmax(router_logits[:, :num_experts].to(acc), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(router_logits.dtype)
    return append_shared_route(weights, ids, router_logits, shared_expert_weight, num_experts)
