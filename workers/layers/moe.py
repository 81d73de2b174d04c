"""Mixture-of-experts layer: routers and the expert computation, tensor-parallel-ready.

Routers turn router logits into (weights [T, k], expert ids [T, k]):
  * `route_softmax_topk`: softmax over all experts, top-k, optional renormalisation
    (Qwen3-MoE / Qwen3-Next).
  * `route_grouped_sigmoid_topk`: sigmoid scores plus a correction bias choose the experts
    within the best groups; the weights are the uncorrected scores (DeepSeek-V3 / Kimi-Linear).
    With every group eligible (Kimi-Linear's one group) it is one Triton launch on CUDA.

`FusedMoE` holds every expert's weights stacked: `w13` [E, 2 * I_local, H] (gate rows, then
up rows) and `w2` [E, H, I_local]. Tensor parallelism splits the intermediate dim, so each
rank computes a partial down projection and the results are all-reduced (or left for the
caller to reduce with its shared expert when `reduce_results=False`).

Checkpoints store one tensor per expert and projection (transformers writes them so even
though its modules hold them fused). The two stacks are child modules that the weight loader
fills shard by shard; `map_expert_weight` maps checkpoint names onto them.

Shared expert folded in (`FusedMoE(shared_expert=True)`): a shared expert of the routed
experts' size, float like them, is expert E of the stacks (E + 1 experts), its checkpoint
tensors (`<mlp>.shared_expert(s).{gate,up,down}_proj`) loading straight there
(`map_shared_expert_weight`), split over ranks on the intermediate dim as the routed
experts are (and as its own gate/up column-parallel, down row-parallel linears were). The
routers then append route k = expert E to every token (`shared_expert_weight`), so a
sparse-MoE layer is router GEMM + router + fused MoE: at batch-1 decode, where launches
bound the step, the shared expert's three launches and the add that joined the two
branches are gone. The fused MoE sums the k + 1 contributions in float32 in slot order
and rounds once (the two-branch path rounded each branch, then their sum).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.kernels.activation import silu_and_mul_ref
from kvloom.kernels.dispatch import TRITON_DTYPES, use_triton
from kvloom.kernels.moe_router import (
    ROUTER_KERNEL_MAX_EXPERTS,
    append_shared_route,
    check_router_args,
    softmax_topk_ref,
)
from kvloom.kernels.ops import fused_moe
from kvloom.workers.layers.linear import check_float_tensor, check_shape
from kvloom.workers.layers.quantization.geometry import Geometry
from kvloom.workers.layers.quantization.scope import weight_device
from kvloom.workers.layers.tp_group import LocalGroup, TPGroup, shard_range

SUPPORTED_ACTIVATIONS = ("silu",)
MAX_ROUTER_EXPERTS = ROUTER_KERNEL_MAX_EXPERTS  # the router kernels' limit (no triton import)

# Checkpoint projection name -> (FusedMoE child, part index within that child).
# Qwen/DeepSeek spell them gate/up/down_proj; Mixtral-style checkpoints (Kimi-Linear) w1/w3/w2.
EXPERT_PROJECTIONS = {
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
    "w1": ("gate_up", 0),
    "w3": ("gate_up", 1),
    "w2": ("down", 0),
}
# A quantized checkpoint stores scales (and int4 packs) beside or instead of `weight`.
EXPERT_PARAMS = (
    "weight|weight_scale_inv|weight_scale|weight_packed|weight_shape|weight_offset|input_scale"
)
_EXPERT_NAME = re.compile(
    rf"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<param>{EXPERT_PARAMS})$"
)
# A shared expert's tensor: `<mlp>.<shared name>.<gate|up|down>_proj.<param>`.
_SHARED_EXPERT_NAME = re.compile(
    r"^(?P<mlp>.+)\.(?P<shared>\w+)\.(?P<proj>gate_proj|up_proj|down_proj)"
    rf"\.(?P<param>{EXPERT_PARAMS})$"
)


def _check_input(field: str, tensor: torch.Tensor, shape: tuple) -> None:
    """Require `shape` (None matches any size) of a runtime input."""
    got = tuple(getattr(tensor, "shape", ()))
    if len(got) != len(shape) or any(w is not None and g != w for g, w in zip(got, shape)):
        wanted = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{field}: expected shape [{wanted}], got {list(got)}")


def _routing_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def route_softmax_topk(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    shared_expert_weight: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (float32, or float64 for float64 logits), the top-k
    probabilities, renormalised to sum to 1 when `renormalize` (norm_topk_prob).
    Weights come back in the logits' dtype, as transformers' Qwen3-Next router returns them;
    ids are int64. With `shared_expert_weight`, route k is a folded shared expert's
    (`kernels.moe_router`; "sigmoid_last_logit" reads its gate logit from the last column).
    On CUDA one Triton launch (`kernels.moe_router_triton`, same answer; read its docstring
    for ties and NaN), else `kernels.moe_router.softmax_topk_ref`."""
    num_experts = check_router_args(router_logits, top_k, shared_expert_weight)
    if use_triton(router_logits) and num_experts <= MAX_ROUTER_EXPERTS:
        # One fused launch (no host sync) for the ~6 torch kernels of the reference.
        from kvloom.kernels.moe_router_triton import softmax_topk_triton

        return softmax_topk_triton(router_logits, top_k, bool(renormalize), shared_expert_weight)
    return softmax_topk_ref(router_logits, top_k, renormalize, shared_expert_weight)


def route_grouped_sigmoid_topk(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    routed_scaling_factor: float = 1.0,
    shared_expert_weight: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing. scores = sigmoid(logits); the choice uses scores + bias: each
    group is rated by the sum of its two best biased scores, the best `topk_groups` groups
    stay eligible, and the top-k biased scores among them pick the experts. The weights are
    the *unbiased* scores of those experts, renormalised (+1e-20) when `renormalize`, then
    times `routed_scaling_factor`. Computed and returned in float32 (float64 for float64
    logits), as transformers' Kimi-Linear router does. With `shared_expert_weight`, route k
    is a folded shared expert's (`kernels.moe_router`), its weight not scaled."""
    num_experts = check_router_args(router_logits, top_k, shared_expert_weight)
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"num_groups must be a positive int, got {num_groups!r}")
    if num_experts % num_groups:
        raise ValueError(
            f"num_groups ({num_groups}) must divide the number of experts ({num_experts})"
        )
    if isinstance(topk_groups, bool) or not isinstance(topk_groups, int):
        raise ValueError(f"topk_groups must be an int, got {topk_groups!r}")
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_groups must be in [1, {num_groups}], got {topk_groups}")
    per_group = num_experts // num_groups
    if top_k > topk_groups * per_group:
        raise ValueError(
            f"top_k ({top_k}) exceeds the experts in the chosen groups "
            f"({topk_groups} x {per_group})"
        )
    if correction_bias is not None:
        _check_input("correction_bias", correction_bias, (num_experts,))
    every_group = topk_groups == num_groups  # the group stage rules nothing out
    if every_group and use_triton(router_logits) and num_experts <= MAX_ROUTER_EXPERTS:
        # One fused launch for the ~15 torch kernels below (Kimi-Linear has one group).
        from kvloom.kernels.moe_router_triton import sigmoid_topk_triton

        return sigmoid_topk_triton(
            router_logits,
            correction_bias,
            top_k,
            bool(renormalize),
            routed_scaling_factor,
            shared_expert_weight,
        )
    dtype = _routing_dtype(router_logits)
    scores = router_logits[:, :num_experts].to(dtype).sigmoid()
    choice = scores
    if correction_bias is not None:
        choice = scores + correction_bias.to(dtype)
    if every_group:
        ids = choice.topk(top_k, dim=-1, sorted=False).indices
    else:
        grouped = choice.view(-1, num_groups, per_group)
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
        best_groups = group_scores.topk(topk_groups, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
        group_mask.scatter_(1, best_groups, True)
        eligible = group_mask.unsqueeze(-1).expand_as(grouped).reshape(-1, num_experts)
        masked = choice.masked_fill(~eligible, float("-inf"))
        ids = masked.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * routed_scaling_factor
    return append_shared_route(weights, ids, router_logits, shared_expert_weight, num_experts)


class StackedExpertWeight(nn.Module):
    """One weight per expert, stacked: `weight` [E, sum(local out parts), local in].

    Checkpoint tensor (expert e, part p) is shard e * num_parts + p. `split` says which dim
    tensor parallelism cuts: "output" cuts every output part (gate/up), "input" cuts the
    input columns (down)."""

    def __init__(
        self,
        num_experts: int,
        output_parts: list[int],
        input_size: int,
        split: str,
        tp: TPGroup,
        dtype: torch.dtype,
    ):
        super().__init__()
        if split not in ("output", "input"):
            raise ValueError(f"split must be 'output' or 'input', got {split!r}")
        self.num_experts = num_experts
        self.output_parts = list(output_parts)
        self.input_size = input_size
        self.split = split
        self.tp = tp
        self.num_shards = num_experts * len(output_parts)
        if split == "output":
            ranges = [shard_range(s, tp.rank, tp.world_size, "expert size") for s in output_parts]
            self.part_ranges = ranges
            self.in_range = (0, input_size)
        else:
            self.part_ranges = [(0, s) for s in output_parts]
            self.in_range = shard_range(input_size, tp.rank, tp.world_size, "expert size")
        self.part_offsets = [0]
        for start, end in self.part_ranges:
            self.part_offsets.append(self.part_offsets[-1] + end - start)
        local_in = self.in_range[1] - self.in_range[0]
        shape = (num_experts, self.part_offsets[-1], local_in)
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=weight_device()), False)
        self.quant_method = None  # set by quantization.apply for a quantized checkpoint

    def quant_geometry(self) -> Geometry:
        return Geometry(
            tuple(self.output_parts),
            tuple(self.part_ranges),
            self.input_size,
            self.in_range,
            num_experts=self.num_experts,
        )

    def load_shard(self, param_name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        if self.quant_method is not None:
            return self.quant_method.load(self, param_name, loaded, shard)
        check_float_tensor(param_name, loaded)
        if param_name != "weight":
            raise ValueError(f"unexpected parameter {param_name!r} for stacked expert weights")
        expert, part = divmod(shard, len(self.output_parts))
        check_shape(param_name, loaded, (self.output_parts[part], self.input_size))
        (row_start, row_end), (col_start, col_end) = self.part_ranges[part], self.in_range
        offset = self.part_offsets[part]
        self.weight.data[expert, offset : offset + row_end - row_start].copy_(
            loaded[row_start:row_end, col_start:col_end]
        )


class FusedMoE(nn.Module):
    """Routed experts: out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]).

    `shared_expert`: the stacks hold one more expert, id `num_experts` (`shared_expert_id`),
    the layer's shared expert, which its router routes every token to (module docstring)."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        tp: TPGroup | None = None,
        dtype: torch.dtype = torch.float32,
        hidden_act: str = "silu",
        reduce_results: bool = True,
        shared_expert: bool = False,
    ):
        super().__init__()
        if hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"hidden_act must be one of {SUPPORTED_ACTIVATIONS}, got {hidden_act!r}"
            )
        for name, value in (("num_experts", num_experts), ("top_k", top_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if top_k > num_experts:
            raise ValueError(f"top_k ({top_k}) exceeds num_experts ({num_experts})")
        self.tp = tp or LocalGroup()
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.reduce_results = reduce_results
        self.shared_expert = bool(shared_expert)
        stacked = num_experts + self.shared_expert
        parts = [intermediate_size, intermediate_size]
        self.gate_up = StackedExpertWeight(stacked, parts, hidden_size, "output", self.tp, dtype)
        self.down = StackedExpertWeight(
            stacked, [hidden_size], intermediate_size, "input", self.tp, dtype
        )

    @property
    def shared_expert_id(self) -> int | None:
        """The folded shared expert's id (after the routed ones), None without one."""
        return self.num_experts if self.shared_expert else None

    @property
    def w13(self) -> torch.Tensor:
        """[E (+ 1), 2 * I_local, H]: gate rows then up rows of this rank's intermediate
        slice."""
        return self.gate_up.weight

    @property
    def w2(self) -> torch.Tensor:
        """[E (+ 1), H, I_local]."""
        return self.down.weight

    def forward(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """hidden [T, H], topk_weights [T, k], topk_ids [T, k] -> [T, H] in hidden's dtype."""
        _check_input("hidden", hidden, (None, self.hidden_size))
        _check_input("topk_ids", topk_ids, (hidden.shape[0], None))
        _check_input("topk_weights", topk_weights, tuple(topk_ids.shape))
        if self.gate_up.quant_method is not None:
            out = self.gate_up.quant_method.moe_forward(self, hidden, topk_weights, topk_ids)
        elif use_triton(hidden):
            # One fused launch sequence with no host sync (CUDA graphs capture it).
            # The kernel reads half-precision weights as float32 itself (exact), so no cast
            # launch; only a dtype it does not take is converted.
            if topk_weights.dtype not in TRITON_DTYPES:
                topk_weights = topk_weights.float()
            out = fused_moe(hidden, self.w13, self.w2, topk_weights, topk_ids)
        else:
            out = self._expert_loop(hidden, topk_weights, topk_ids)
        if self.reduce_results and self.tp.world_size > 1:
            out = self.tp.all_reduce(out)
        return out

    def _expert_loop(self, hidden, topk_weights, topk_ids) -> torch.Tensor:
        """The reference path: validates expert ids (a host sync), then loops experts."""
        out = torch.zeros_like(hidden)
        stacked = self.w13.shape[0]
        if topk_ids.numel():
            lo, hi = int(topk_ids.min()), int(topk_ids.max())
            if lo < 0 or hi >= stacked:
                raise ValueError(f"topk_ids: expert ids must be in [0, {stacked})")
        # Experts in ascending order, each over the tokens routed to it, as transformers
        # loops, so fp32 sums accumulate in the same order (a folded shared expert, the
        # highest id, comes last: where the two-branch path added it).
        for expert in torch.unique(topk_ids).tolist():
            tokens, slot = torch.nonzero(topk_ids == expert, as_tuple=True)
            x = hidden[tokens]
            act = silu_and_mul_ref(F.linear(x, self.w13[expert]))
            y = F.linear(act, self.w2[expert]) * topk_weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out


def map_expert_weight(ckpt_name: str) -> tuple[str, str, int] | None:
    """`<prefix>.experts.<e>.<proj>.<param>` -> (`<prefix>.experts.<child>`, param, shard)
    for a FusedMoE at `<prefix>.experts`; None for any other name. Use it from a model's
    `map_weight_name`."""
    match = _EXPERT_NAME.match(ckpt_name)
    if match is None or match["proj"] not in EXPERT_PROJECTIONS:
        return None
    child, part = EXPERT_PROJECTIONS[match["proj"]]
    num_parts = 2 if child == "gate_up" else 1
    shard = int(match["expert"]) * num_parts + part
    return f"{match['prefix']}.{child}", match["param"], shard


def map_shared_expert_weight(
    model: nn.Module, ckpt_name: str, shared_name: str
) -> tuple[str, str, int] | None:
    """`<mlp>.<shared_name>.<gate|up|down>_proj.<param>` -> the FusedMoE `<mlp>.experts`
    entry of its expert E, where that FusedMoE folds its shared expert in (looked up in
    `model`, whose module paths are the checkpoint's names as the model maps them); None
    for any other name, or where the layer keeps its shared expert apart."""
    match = _SHARED_EXPERT_NAME.match(ckpt_name)
    if match is None or match["shared"] != shared_name:
        return None
    try:
        experts = model.get_submodule(f"{match['mlp']}.experts")
    except AttributeError:
        return None
    if not isinstance(experts, FusedMoE) or experts.shared_expert_id is None:
        return None
    child, part = EXPERT_PROJECTIONS[match["proj"]]
    num_parts = 2 if child == "gate_up" else 1
    shard = experts.shared_expert_id * num_parts + part
    return f"{match['mlp']}.experts.{child}", match["param"], shard
