"""Softmax top-k MoE routing in one launch: the Triton kernel (and the sigmoid router's
ungrouped case, `sigmoid_topk_triton`, at the end).

Same semantics as `moe_router.softmax_topk_ref` (softmax over experts in float32, the k
largest probabilities sorted descending, renormalised by their sum when asked, weights in
the logits' dtype, ids int64). Unfused, torch spends ~6 launches per MoE layer on it
(cast, softmax, topk, sum, divide, cast); here one program per token holds its whole row
of logits in registers and writes the k weights and ids.

Choice: top-k of the softmax is top-k of the logits (exp is monotone), so the experts are
picked on the logits themselves, exactly, in any dtype. Each logit becomes one int64 key,
its float32 value mapped to an order-preserving integer in the high half and
(E_PAD - 1 - expert) in the low half, so keys are distinct and a max reduction yields the
value and, on ties, the lowest expert id; picked lanes' keys are then knocked out.

Speed (batch-1 decode, where one program per token is all there is: a chain of dependent
warp reductions, each five shuffle rounds at 32 lanes): an H100 timed the first version,
one max reduction per pick with the pick's weight computed inside the loop, at 6.5 us per
launch for Qwen3-Next's 512 experts / top 10 and 4.0 us for Kimi-Linear's 256 / top 8 (the
sigmoid router also summed a lane out per pick: a second reduction). Now each reduction
yields the two largest keys (`_top2`: a pair per lane, merged pairwise), so k picks take
ceil(k / 2) reductions, and the weights are computed once after the loop from the picked
keys (softmax) or from the picked logits reloaded (sigmoid): the same picks in the same
order and the same arithmetic per weight, so the same bits (tests compare both plans).

Weights follow the reference's rounding points: m = max logit, s = sum_e exp(l_e - m),
p_j = exp(l_j - m) / s for each pick, and when renormalising p_j / sum_j p_j (the
reference divides the already-rounded probabilities by their float32 sum), with
correctly rounded division (`div_rn`) and `gdn_gates_triton.exp_f32` (a few ulps; the
compiled tl.exp loses up to |x| * 2^-24 relative). Only the order of the two sums and
exp's last bits differ from torch, so float32 weights agree to a few ulps and
half-precision ones after their final rounding (rare one-ulp flips).

Defined edge cases (the reference's NaN ordering is torch.topk's and unspecified on ties):
  * Ties: the lowest expert id comes first.
  * NaN: a row with any NaN logit gets all-NaN weights (the softmax is NaN, as in torch);
    its NaN experts rank above every number (as torch.topk ranks NaN), lowest id first.
    Ids are always distinct and in [0, E): a pick only ever lands on a lane holding a
    real expert that was not picked yet (k <= E), and the id is clamped besides.
  * +inf logits make the row's softmax NaN, as in torch; -inf logits are probability 0.

Shared expert route (`shared_expert_weight`, see `moe_router`): both kernels can append it
as slot k in the same launch, id E, weight 1 or sigmoid(the row's last logit) computed as
the sigmoid router computes its scores (1 / (1 + exp_f32(-x)), correctly rounded division)
and cast to the output dtype. The routed slots are exactly those of a launch without it.

No host synchronisation: the launch is CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.kernels.arg_checks_triton import check_dtype, next_power_of_2
from kvloom.kernels.gdn_gates_triton import exp_f32
from kvloom.kernels.moe_router import ROUTER_KERNEL_MAX_EXPERTS, check_router_args

MAX_EXPERTS = ROUTER_KERNEL_MAX_EXPERTS
KNOCKED_OUT = tl.constexpr(-(2**63))  # below every real key: picked lanes and padding
# Keys picked per max reduction (`_pick_keys`): 2, or 1 (the first version's one pick per
# reduction; tests and benchmarks/router_picks.py compare the two). The same picks either way.
PICKS_PER_ROUND = 2
# The kernels' SHARED constexpr for each `shared_expert_weight`.
SHARED_MODES = {None: 0, "sigmoid_last_logit": 1, "one": 2}


@triton.jit
def _sortable_key(x):
    """float32 -> int32 whose signed order is the float order (-0.0 just below +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _key_value(key):
    """The inverse of `_sortable_key`."""
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _top2(a1, a2, b1, b2):
    """Combine of a reduction over (largest, second largest) key pairs: the two largest of
    {a1, a2, b1, b2}, given a1 > a2 and b1 > b2 (or equal knocked-out keys)."""
    a_first = a1 > b1
    first = tl.where(a_first, a1, b1)
    second = tl.where(a_first, tl.maximum(a2, b1), tl.maximum(a1, b2))
    return first, second


@triton.jit
def _pick_keys(keys, slots, TOP_K: tl.constexpr, K_PAD: tl.constexpr, PICKS: tl.constexpr):
    """The TOP_K largest of `keys` (distinct where not knocked out), in descending order,
    in slots 0..TOP_K-1 of a [K_PAD] vector (KNOCKED_OUT in the others)."""
    picked = tl.full([K_PAD], KNOCKED_OUT, dtype=tl.int64)
    for j in tl.static_range(0, TOP_K, PICKS):
        if PICKS == 1:
            best = tl.max(keys, axis=0)
            picked = tl.where(slots == j, best, picked)
            keys = tl.where(keys == best, KNOCKED_OUT, keys)
        else:
            best, second = tl.reduce((keys, tl.full(keys.shape, KNOCKED_OUT, tl.int64)), 0, _top2)
            picked = tl.where(slots == j, best, picked)
            if j + 1 < TOP_K:
                picked = tl.where(slots == j + 1, second, picked)
            keys = tl.where((keys == best) | (keys == second), KNOCKED_OUT, keys)
    return picked


@triton.jit
def _key_expert(key, num_experts, E_PAD: tl.constexpr):
    """The expert id in a key's low half (< E_PAD: truncating to int32 keeps it exactly),
    clamped to [0, E) so that no id can point outside the experts."""
    expert = (E_PAD - 1) - key.to(tl.int32)
    return tl.minimum(tl.maximum(expert, 0), num_experts - 1)


@triton.jit
def _sigmoid_f32(x):
    return tl.math.div_rn(1.0, 1.0 + exp_f32(-x))


@triton.jit
def _append_shared_route(
    out_w, out_id, slots, row_ptr, stride_le, num_experts, TOP_K: tl.constexpr, SHARED: tl.constexpr
):
    """Slot TOP_K becomes the shared expert's route (id E = num_experts): weight 1 (SHARED
    2) or sigmoid of the logit in column E (SHARED 1); no change for SHARED 0."""
    if SHARED != 0:
        if SHARED == 1:
            gate = tl.load(row_ptr + num_experts * stride_le).to(tl.float32)
            shared = _sigmoid_f32(gate)
        else:
            shared = 1.0
        out_w = tl.where(slots == TOP_K, shared, out_w)
        out_id = tl.where(slots == TOP_K, num_experts, out_id)
    return out_w, out_id


def _shared_mode(shared_expert_weight) -> int:
    """The SHARED constexpr (the value was checked by `check_router_args`)."""
    return SHARED_MODES[shared_expert_weight]


def check_picks(picks_per_round) -> int:
    if picks_per_round not in (1, 2):
        raise ValueError(f"picks_per_round must be 1 or 2, got {picks_per_round!r}")
    return picks_per_round


def check_renormalize(renormalize) -> bool:
    if not isinstance(renormalize, bool):
        raise ValueError(f"renormalize must be a bool, got {renormalize!r}")
    return renormalize


def router_num_warps(num_experts: int) -> int:
    """The router launch's warps: one per 1024 experts (small rows reduce with warp
    shuffles alone). Its reductions' order follows them, so a fused router uses the same."""
    return max(1, min(8, next_power_of_2(num_experts) // 1024))


def routes_out(num_tokens, top_k, shared_expert_weight, dtype, device):
    """Output buffers: k columns, k + 1 with a shared route."""
    width = top_k + (shared_expert_weight is not None)
    weights = torch.empty((num_tokens, width), dtype=dtype, device=device)
    ids = torch.empty((num_tokens, width), dtype=torch.int64, device=device)
    return weights, ids


@triton.jit
def _softmax_topk_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_lt,
    stride_le,
    stride_wt,
    stride_it,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SHARED: tl.constexpr,
    PICKS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    softmax_topk_row(
        logits_ptr + token * stride_lt, stride_le, weights_ptr + token * stride_wt,
        ids_ptr + token * stride_it, num_experts, TOP_K, K_PAD, E_PAD, RENORMALIZE, SHARED, PICKS,
    )  # fmt: skip


@triton.jit
def softmax_topk_row(
    row_ptr,
    stride_le,
    w_row_ptr,
    id_row_ptr,
    num_experts,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SHARED: tl.constexpr,
    PICKS: tl.constexpr,
):
    """One token's routes: its logits at row_ptr (stride_le apart) -> its k (k + 1 with a
    shared route) weights at w_row_ptr and ids at id_row_ptr. The router launch runs it
    once per program; the router GEMV's route epilogue (gemv_triton) in its last program."""
    experts = tl.arange(0, E_PAD)
    real = experts < num_experts
    logits = tl.load(row_ptr + experts * stride_le, mask=real, other=float("-inf")).to(tl.float32)
    is_nan = logits != logits
    has_nan = tl.max(is_nan.to(tl.int32), axis=0) > 0
    # NaN ranks above everything (torch.topk's order); weights of such rows become NaN below.
    value = tl.where(is_nan, float("inf"), logits)
    row_max = tl.max(value, axis=0)
    denom = tl.sum(tl.where(real, exp_f32(logits - row_max), 0.0), axis=0)

    low = (E_PAD - 1 - experts).to(tl.int64)
    keys = tl.where(real, (_sortable_key(value).to(tl.int64) << 32) | low, KNOCKED_OUT)
    slots = tl.arange(0, K_PAD)
    picked = _pick_keys(keys, slots, TOP_K, K_PAD, PICKS)
    routed = slots < TOP_K
    out_id = tl.where(routed, _key_expert(picked, num_experts, E_PAD), 0).to(tl.int64)
    prob = tl.math.div_rn(exp_f32(_key_value((picked >> 32).to(tl.int32)) - row_max), denom)
    out_w = tl.where(routed, prob, 0.0)
    if RENORMALIZE:
        out_w = tl.math.div_rn(out_w, tl.sum(out_w, axis=0))  # unused slots hold 0
    out_w = tl.where(has_nan, float("nan"), out_w)
    # After the renormalisation and the NaN rule: they concern the routed slots only.
    out_w, out_id = _append_shared_route(
        out_w, out_id, slots, row_ptr, stride_le, num_experts, TOP_K, SHARED
    )
    used = slots < TOP_K + (SHARED != 0)
    tl.store(w_row_ptr + slots, out_w.to(w_row_ptr.dtype.element_ty), mask=used)
    tl.store(id_row_ptr + slots, out_id, mask=used)


def softmax_topk_triton(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    shared_expert_weight: str | None = None,
    picks_per_round: int = PICKS_PER_ROUND,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (float16/bfloat16/float32, any strides, E <= MAX_EXPERTS; one
    more column with "sigmoid_last_logit") -> (weights [T, k] in the logits' dtype, ids
    [T, k] int64), both contiguous; k + 1 columns with a shared route. `picks_per_round`
    (1 or 2, `PICKS_PER_ROUND`) changes the speed only."""
    num_experts = check_router_args(router_logits, top_k, shared_expert_weight)
    check_dtype("router_logits", router_logits)
    if num_experts > MAX_EXPERTS:
        raise ValueError(
            f"router_logits: {num_experts} experts exceed the kernel's limit {MAX_EXPERTS}"
        )
    check_renormalize(renormalize)
    num_tokens = router_logits.shape[0]
    weights, ids = routes_out(
        num_tokens, top_k, shared_expert_weight, router_logits.dtype, router_logits.device
    )
    if num_tokens == 0:
        return weights, ids
    e_pad = next_power_of_2(num_experts)
    _softmax_topk_kernel[(num_tokens,)](
        router_logits,
        weights,
        ids,
        num_experts,
        router_logits.stride(0),
        router_logits.stride(1),
        weights.stride(0),
        ids.stride(0),
        TOP_K=top_k,
        K_PAD=next_power_of_2(weights.shape[1]),
        E_PAD=e_pad,
        RENORMALIZE=renormalize,
        SHARED=_shared_mode(shared_expert_weight),
        PICKS=check_picks(picks_per_round),
        num_warps=router_num_warps(num_experts),
        enable_fp_fusion=False,  # round as torch does: no fused multiply-adds
    )
    return weights, ids


@triton.jit
def _sigmoid_topk_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    scaling,
    stride_lt,
    stride_le,
    stride_wt,
    stride_it,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SHARED: tl.constexpr,
    PICKS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, E_PAD)
    real = experts < num_experts
    row_ptr = logits_ptr + token * stride_lt
    logits = tl.load(row_ptr + experts * stride_le, mask=real, other=0.0).to(tl.float32)
    scores = _sigmoid_f32(logits)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + experts, mask=real, other=0.0).to(tl.float32)
    # NaN ranks above everything (torch.topk's order); its weight stays NaN.
    value = tl.where(choice != choice, float("inf"), choice)
    low = (E_PAD - 1 - experts).to(tl.int64)
    keys = tl.where(real, (_sortable_key(value).to(tl.int64) << 32) | low, KNOCKED_OUT)
    slots = tl.arange(0, K_PAD)
    picked = _pick_keys(keys, slots, TOP_K, K_PAD, PICKS)
    routed = slots < TOP_K
    out_id = tl.where(routed, _key_expert(picked, num_experts, E_PAD), 0).to(tl.int64)
    # The picks' unbiased scores: their logits read again (L1/L2-hot) and put through the
    # same sigmoid, so the same values as the lanes' scores, with no reduction per pick.
    picked_logits = tl.load(row_ptr + out_id * stride_le, mask=routed, other=0.0)
    out_w = tl.where(routed, _sigmoid_f32(picked_logits.to(tl.float32)), 0.0)
    if RENORMALIZE:
        out_w = tl.math.div_rn(out_w, tl.sum(out_w, axis=0) + 1e-20)  # unused slots hold 0
    out_w = out_w * scaling
    # After the renormalisation and scaling: they concern the routed slots only.
    out_w, out_id = _append_shared_route(
        out_w, out_id, slots, row_ptr, stride_le, num_experts, TOP_K, SHARED
    )
    used = slots < TOP_K + (SHARED != 0)
    tl.store(weights_ptr + token * stride_wt + slots, out_w, mask=used)
    tl.store(ids_ptr + token * stride_it + slots, out_id, mask=used)


def sigmoid_topk_triton(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    routed_scaling_factor: float = 1.0,
    shared_expert_weight: str | None = None,
    picks_per_round: int = PICKS_PER_ROUND,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / Kimi-Linear routing with every expert group eligible (one group, or
    topk_groups == num_groups), one launch: scores = sigmoid(logits), the top-k of scores +
    bias choose (ties: lowest expert id first, picks in descending order), the weights are
    the unbiased scores, over their sum + 1e-20 when `renormalize`, times the scaling, in
    float32 as `workers.layers.moe.route_grouped_sigmoid_topk` computes them (sigmoid
    within a few ulps of torch's). router_logits [T, E] (float16/bfloat16/float32, any
    strides), correction_bias [E] or None -> (weights [T, k] float32, ids [T, k] int64);
    k + 1 columns with a shared route (its weight unscaled, `moe_router`).
    Replaces some fifteen torch launches per MoE layer; CUDA-graph capturable.
    `picks_per_round` as in `softmax_topk_triton`."""
    num_experts = check_router_args(router_logits, top_k, shared_expert_weight)
    check_dtype("router_logits", router_logits)
    if num_experts > MAX_EXPERTS:
        raise ValueError(
            f"router_logits: {num_experts} experts exceed the kernel's limit {MAX_EXPERTS}"
        )
    if correction_bias is not None:
        if tuple(correction_bias.shape) != (num_experts,):
            raise ValueError(
                f"correction_bias: expected shape [{num_experts}], got "
                f"{list(correction_bias.shape)}"
            )
        check_dtype("correction_bias", correction_bias)
        correction_bias = correction_bias.contiguous()
    if not isinstance(renormalize, bool):
        raise ValueError(f"renormalize must be a bool, got {renormalize!r}")
    num_tokens = router_logits.shape[0]
    weights, ids = routes_out(
        num_tokens, top_k, shared_expert_weight, torch.float32, router_logits.device
    )
    if num_tokens == 0:
        return weights, ids
    e_pad = next_power_of_2(num_experts)
    _sigmoid_topk_kernel[(num_tokens,)](
        router_logits,
        correction_bias if correction_bias is not None else router_logits,
        weights,
        ids,
        num_experts,
        float(routed_scaling_factor),
        router_logits.stride(0),
        router_logits.stride(1),
        weights.stride(0),
        ids.stride(0),
        TOP_K=top_k,
        K_PAD=next_power_of_2(weights.shape[1]),
        E_PAD=e_pad,
        HAS_BIAS=correction_bias is not None,
        RENORMALIZE=renormalize,
        SHARED=_shared_mode(shared_expert_weight),
        PICKS=check_picks(picks_per_round),
        num_warps=router_num_warps(num_experts),
        enable_fp_fusion=False,  # round as torch does: no fused multiply-adds
    )
    return weights, ids
