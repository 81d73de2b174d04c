"""The shared MoE layer: routers against transformers' routers, FusedMoE against
transformers' expert loop, checkpoint loading through the weight loader, and a simulated
two-rank tensor-parallel split that sums to the one-rank result."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearTopkRouter
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextExperts,
    Qwen3NextTopKRouter,
)

from kvloom.workers.layers.moe import (
    FusedMoE,
    map_expert_weight,
    route_grouped_sigmoid_topk,
    route_softmax_topk,
)
from kvloom.workers.weight_loader import load_weights

E, K, H, INTER, T = 8, 3, 24, 10, 37


def qwen_config(norm_topk_prob: bool):
    return transformers.Qwen3NextConfig(
        hidden_size=H,
        num_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=INTER,
        norm_topk_prob=norm_topk_prob,
    )


def sorted_by_id(weights: torch.Tensor, ids: torch.Tensor):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_matches_qwen3_next_router(renormalize):
    torch.manual_seed(0)
    router = Qwen3NextTopKRouter(qwen_config(renormalize))
    nn.init.normal_(router.weight, std=0.5)
    hidden = torch.randn(T, H)
    logits, ref_w, ref_ids = router(hidden)
    weights, ids = route_softmax_topk(logits, K, renormalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=0, atol=1e-7)
    assert weights.dtype == logits.dtype
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(T))


def test_softmax_topk_float64_stays_float64():
    logits = torch.randn(5, E, dtype=torch.float64)
    weights, ids = route_softmax_topk(logits, 2, True)
    assert weights.dtype == torch.float64
    probs = logits.softmax(-1)
    top = probs.topk(2, dim=-1)
    torch.testing.assert_close(weights, top.values / top.values.sum(-1, keepdim=True))
    assert torch.equal(ids, top.indices)


@pytest.mark.parametrize(
    ("num_groups", "topk_groups", "renormalize", "scale"),
    [(4, 2, True, 2.5), (2, 1, False, 1.0), (1, 1, True, 1.0)],
)
def test_grouped_sigmoid_topk_matches_kimi_linear_router(
    num_groups, topk_groups, renormalize, scale
):
    torch.manual_seed(1)
    config = transformers.KimiLinearConfig(
        hidden_size=H,
        num_experts=E,
        num_experts_per_tok=K if topk_groups * (E // num_groups) >= K else 2,
        n_group=num_groups,
        topk_group=topk_groups,
        norm_topk_prob=renormalize,
        routed_scaling_factor=scale,
    )
    router = KimiLinearTopkRouter(config)
    nn.init.normal_(router.weight, std=0.5)
    router.e_score_correction_bias.copy_(torch.randn(E) * 0.3)
    hidden = torch.randn(T, H)
    logits, ref_w, ref_ids = router(hidden)
    weights, ids = route_grouped_sigmoid_topk(
        logits,
        router.e_score_correction_bias,
        router.top_k,
        num_groups,
        topk_groups,
        renormalize,
        scale,
    )
    # Both pick with sorted=False: compare per token as sets, weights matched by id.
    weights, ids = sorted_by_id(weights, ids)
    ref_w, ref_ids = sorted_by_id(ref_w, ref_ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=0, atol=1e-6)


def test_grouped_routing_only_picks_experts_of_chosen_groups():
    torch.manual_seed(2)
    logits = torch.randn(64, E)
    bias = torch.randn(E)
    _, ids = route_grouped_sigmoid_topk(logits, bias, 2, 4, 1, True)
    groups = ids // (E // 4)
    assert torch.equal(groups[:, 0], groups[:, 1])  # one group per token, both experts in it


def test_router_bad_input_names_the_field():
    logits = torch.randn(3, E)
    with pytest.raises(ValueError, match="top_k"):
        route_softmax_topk(logits, E + 1, True)
    with pytest.raises(ValueError, match="router_logits"):
        route_softmax_topk(torch.randn(E), 2, True)
    with pytest.raises(ValueError, match="num_groups"):
        route_grouped_sigmoid_topk(logits, None, 2, 3, 1, True)
    with pytest.raises(ValueError, match="topk_groups"):
        route_grouped_sigmoid_topk(logits, None, 2, 4, 5, True)
    with pytest.raises(ValueError, match="correction_bias"):
        route_grouped_sigmoid_topk(logits, torch.zeros(E + 1), 2, 4, 2, True)


class Holder(nn.Module):
    """A minimal 'model' whose FusedMoE sits at `mlp.experts`, as in the real models."""

    def __init__(self, moe: FusedMoE):
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.experts = moe

    @staticmethod
    def map_weight_name(name):
        return map_expert_weight(name)


def per_expert_tensors(hf: Qwen3NextExperts, names=("gate_proj", "up_proj", "down_proj")):
    """The per-expert tensors transformers' save_pretrained writes for these experts."""
    gate, up, down = names
    out = []
    for e in range(hf.num_experts):
        g, u = hf.gate_up_proj[e].chunk(2, dim=0)
        out += [
            (f"mlp.experts.{e}.{gate}.weight", g.clone()),
            (f"mlp.experts.{e}.{up}.weight", u.clone()),
            (f"mlp.experts.{e}.{down}.weight", hf.down_proj[e].clone()),
        ]
    return out


@pytest.fixture(scope="module")
def hf_experts():
    torch.manual_seed(3)
    hf = Qwen3NextExperts(qwen_config(True))
    nn.init.normal_(hf.gate_up_proj, std=0.3)
    nn.init.normal_(hf.down_proj, std=0.3)
    return hf


def loaded_moe(tensors, tp=None, reduce_results=True) -> FusedMoE:
    moe = FusedMoE(E, K, H, INTER, tp=tp, reduce_results=reduce_results)
    holder = Holder(moe)
    load_weights(holder, tensors)
    return moe


@pytest.mark.parametrize("names", [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")])
def test_fused_moe_matches_transformers_experts(hf_experts, names):
    moe = loaded_moe(per_expert_tensors(hf_experts, names))
    torch.testing.assert_close(moe.w13, hf_experts.gate_up_proj.detach(), rtol=0, atol=0)
    torch.testing.assert_close(moe.w2, hf_experts.down_proj.detach(), rtol=0, atol=0)
    torch.manual_seed(4)
    hidden = torch.randn(T, H)
    weights, ids = route_softmax_topk(torch.randn(T, E), K, True)
    with torch.no_grad():
        ref = hf_experts(hidden, ids, weights)
    out = moe(hidden, weights, ids)
    err = (out - ref).abs().max().item()
    assert err <= 1e-6, err
    # Experts nobody routed to contribute nothing: route everything to expert 0 only.
    only0 = moe(hidden, torch.ones(T, 1), torch.zeros(T, 1, dtype=torch.long))
    with torch.no_grad():
        ref0 = hf_experts(hidden, torch.zeros(T, 1, dtype=torch.long), torch.ones(T, 1))
    torch.testing.assert_close(only0, ref0, rtol=0, atol=1e-6)


class FakeRank:
    """Rank r of a simulated TP group; reduction is done by the test (reduce_results=False)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, tensor):
        raise AssertionError("reduce_results=False must not all-reduce")

    def all_gather(self, tensor, dim=-1):
        raise AssertionError("not used")


def test_tensor_parallel_shards_sum_to_the_full_result(hf_experts):
    tensors = per_expert_tensors(hf_experts)
    full = loaded_moe(tensors)
    torch.manual_seed(5)
    hidden = torch.randn(T, H)
    weights, ids = route_softmax_topk(torch.randn(T, E), K, True)
    parts = [loaded_moe(tensors, tp=FakeRank(r, 2), reduce_results=False) for r in range(2)]
    assert parts[0].w13.shape == (E, INTER, H) and parts[0].w2.shape == (E, H, INTER // 2)
    total = sum(p(hidden, weights, ids) for p in parts)
    torch.testing.assert_close(total, full(hidden, weights, ids), rtol=0, atol=1e-5)


def test_missing_and_misshaped_expert_weights_are_named(hf_experts):
    tensors = per_expert_tensors(hf_experts)
    with pytest.raises(ValueError, match=r"missing 1 weight.*mlp\.experts\.down\.weight"):
        loaded_moe([t for t in tensors if t[0] != "mlp.experts.5.down_proj.weight"])
    bad = [(n, t[:, :-1] if n == "mlp.experts.2.up_proj.weight" else t) for n, t in tensors]
    with pytest.raises(ValueError, match=r"mlp\.experts\.2\.up_proj\.weight"):
        loaded_moe(bad)
    extra = tensors + [("mlp.experts.8.gate_proj.weight", torch.zeros(INTER, H))]
    with pytest.raises(ValueError, match=r"unexpected weight 'mlp\.experts\.8\.gate_proj"):
        loaded_moe(extra)


def test_fused_moe_bad_input_names_the_field(hf_experts):
    moe = loaded_moe(per_expert_tensors(hf_experts))
    hidden = torch.randn(4, H)
    with pytest.raises(ValueError, match="topk_ids"):
        moe(hidden, torch.ones(4, 2), torch.full((4, 2), E))
    with pytest.raises(ValueError, match="topk_weights"):
        moe(hidden, torch.ones(4, 3), torch.zeros(4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="hidden_act"):
        FusedMoE(E, K, H, INTER, hidden_act="gelu")
    with pytest.raises(ValueError, match="top_k"):
        FusedMoE(E, E + 1, H, INTER)


def test_map_expert_weight_ignores_other_names():
    assert map_expert_weight("model.layers.0.mlp.gate.weight") is None
    assert map_expert_weight("model.layers.0.mlp.shared_expert.gate_proj.weight") is None
    assert map_expert_weight("model.layers.3.mlp.experts.2.up_proj.weight") == (
        "model.layers.3.mlp.experts.gate_up",
        "weight",
        5,
    )
