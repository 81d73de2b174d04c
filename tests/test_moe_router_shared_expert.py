"""The routers' shared-expert route (issue 23): with `shared_expert_weight` both fused
router kernels (softmax top-k, Qwen3-Next; sigmoid top-k, Kimi-Linear) append route k =
expert E to every token, weight sigmoid(the logits' last column) or 1, in the same launch.

Against the torch references with the same option. Interpreted on the CPU at small shapes,
compiled on a GPU (plus the real routers' shapes, `gpu`). What is bitwise: the expert ids
(whole rows), the k routed columns (equal to a launch without the option, whose own checks
are tests/test_moe_router*.py), the shared id E and the weight 1. The sigmoid weight is
held to the existing tests' weight tolerances: float32 within 2e-6 relative (the kernel's
sigmoid is exp_f32 and a correctly rounded division, torch's its own), half precision
within one unit in the last place of the reference.
"""

from __future__ import annotations

import pytest
import torch

from kvloom.kernels.moe_router import SHARED_EXPERT_WEIGHTS, softmax_topk_ref
from kvloom.kernels.moe_router_triton import sigmoid_topk_triton, softmax_topk_triton
from kvloom.workers.layers import moe
from tests.kernel_env import DEVICE, gpu, needs_cuda
from tests.test_moe_router import assert_weights_close, distinct_logits, seed_of
from tests.test_moe_router_sigmoid import case_bias

MODES = ("sigmoid_last_logit", "one")


def gate_column(tokens, dtype, seed):
    """A shared-gate logit per token: both signs, some far out (sigmoid near 0 and 1)."""
    gen = torch.Generator().manual_seed(seed)
    column = torch.randn(tokens, 1, generator=gen) * 3.0
    column[::3] *= 4.0
    return column.to(dtype).to(DEVICE)


def with_gate(routed_logits, mode, seed):
    """The router's input for `mode`: the routed logits, plus the gate column where the
    mode reads one (as the fused router GEMM lays them out: one contiguous [T, E + 1])."""
    if mode != "sigmoid_last_logit":
        return routed_logits
    gate = gate_column(routed_logits.shape[0], routed_logits.dtype, seed)
    return torch.cat([routed_logits, gate], dim=1)


def check_shared_column(name, weights, ids, logits, mode, num_experts, top_k, want_shared):
    """Column k: id E everywhere; weight 1 exactly, or the reference's sigmoid weight."""
    assert weights.shape == ids.shape == (logits.shape[0], top_k + 1), name
    assert (ids[:, top_k] == num_experts).all(), f"{name}: shared id"
    if mode == "one":
        assert (weights[:, top_k] == 1).all(), f"{name}: shared weight not 1"
    else:
        assert_weights_close(f"{name} shared", weights[:, top_k:], want_shared)


SOFTMAX_CASES = [
    # tokens, experts, top_k, renormalize, dtype
    (3, 8, 2, True, torch.float32),
    (3, 8, 2, False, torch.bfloat16),
    (2, 60, 4, True, torch.float16),
    (3, 512, 10, True, torch.bfloat16),  # Qwen3-Next's router width
    (2, 512, 10, True, torch.float32),
    (2, 7, 7, False, torch.float32),  # k = E: K_PAD must grow for the extra slot
    (2, 8, 7, True, torch.bfloat16),  # k + 1 = 8, a power of two
    (4, 1, 1, True, torch.float32),  # one routed expert
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tokens,experts,top_k,renormalize,dtype", SOFTMAX_CASES)
def test_softmax_router_appends_the_shared_route(tokens, experts, top_k, renormalize, dtype, mode):
    case = (tokens, experts, top_k, renormalize, dtype)
    name = f"softmax T{tokens} E{experts} k{top_k} r{renormalize} {dtype} {mode}"
    routed_logits = distinct_logits(tokens, experts, dtype, seed_of("shared", *case))
    logits = with_gate(routed_logits, mode, seed_of("gate", *case))
    before = logits.clone()
    weights, ids = softmax_topk_triton(logits, top_k, renormalize, mode)
    assert torch.equal(logits, before), f"{name}: the logits were written"
    assert weights.dtype == dtype and weights.is_contiguous() and ids.is_contiguous()
    ref_w, ref_ids = softmax_topk_ref(logits, top_k, renormalize, mode)
    assert torch.equal(ids, ref_ids), f"{name}: ids differ from the reference"
    # The routed columns are a plain launch's, bit for bit (the option touches slot k only).
    plain_w, plain_ids = softmax_topk_triton(routed_logits, top_k, renormalize)
    assert torch.equal(weights[:, :top_k], plain_w) and torch.equal(ids[:, :top_k], plain_ids)
    # The reference's routed columns are its plain answer, and its shared weight is
    # torch's sigmoid of the gate column in the logits' dtype (what gated_add applied).
    ref_plain_w, ref_plain_ids = softmax_topk_ref(routed_logits, top_k, renormalize)
    assert torch.equal(ref_w[:, :top_k], ref_plain_w)
    assert torch.equal(ref_ids[:, :top_k], ref_plain_ids)
    if mode == "sigmoid_last_logit":
        assert torch.equal(ref_w[:, top_k:], torch.sigmoid(logits[:, experts:]))
    check_shared_column(name, weights, ids, logits, mode, experts, top_k, ref_w[:, top_k:])


SIGMOID_CASES = [
    # tokens, experts, top_k, renormalize, with_bias, scaling, dtype
    (3, 8, 2, True, True, 1.0, torch.float32),
    (3, 256, 8, True, True, 2.446, torch.float32),  # Kimi-Linear's router
    (2, 64, 6, False, False, 1.0, torch.bfloat16),
    (2, 5, 5, True, True, 1.0, torch.float32),  # k = E
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tokens,experts,top_k,renormalize,with_bias,scaling,dtype", SIGMOID_CASES)
def test_sigmoid_router_appends_the_shared_route(
    tokens, experts, top_k, renormalize, with_bias, scaling, dtype, mode
):
    case = (tokens, experts, top_k, renormalize, with_bias, scaling, dtype)
    name = f"sigmoid T{tokens} E{experts} k{top_k} {dtype} {mode}"
    routed_logits = distinct_logits(tokens, experts, dtype, seed_of("shared sigmoid", *case))
    logits = with_gate(routed_logits, mode, seed_of("gate sigmoid", *case))
    bias = case_bias(experts, seed_of("bias", *case), with_bias)
    weights, ids = sigmoid_topk_triton(logits, bias, top_k, renormalize, scaling, mode)
    assert weights.dtype == torch.float32
    plain_w, plain_ids = sigmoid_topk_triton(routed_logits, bias, top_k, renormalize, scaling)
    assert torch.equal(weights[:, :top_k], plain_w) and torch.equal(ids[:, :top_k], plain_ids)
    # The layer's torch path: its routed part is its plain answer, then the shared route
    # (the weight unscaled: routed_scaling_factor is the routed experts').
    cpu_bias = None if bias is None else bias.cpu()
    ref_w, ref_ids = moe.route_grouped_sigmoid_topk(
        logits.cpu(), cpu_bias, top_k, 1, 1, renormalize, scaling, mode
    )
    ref_plain = moe.route_grouped_sigmoid_topk(
        routed_logits.cpu(), cpu_bias, top_k, 1, 1, renormalize, scaling
    )
    assert torch.equal(ref_w[:, :top_k], ref_plain[0])
    assert torch.equal(ref_ids[:, :top_k], ref_plain[1])
    assert torch.equal(ref_ids[:, top_k], torch.full((tokens,), experts))
    want = torch.sigmoid(logits[:, experts:].cpu().float())
    if mode == "sigmoid_last_logit":
        assert torch.equal(ref_w[:, top_k:], want)
    check_shared_column(name, weights.cpu(), ids.cpu(), logits, mode, experts, top_k, want)


def test_grouped_reference_appends_the_shared_route():
    """Kimi-Linear with several expert groups takes the torch path: same shared route."""
    logits = distinct_logits(5, 16, torch.float32, seed=21, device="cpu")
    bias = case_bias(16, 22, True).cpu()
    plain_w, plain_ids = moe.route_grouped_sigmoid_topk(logits, bias, 3, 4, 2, True, 2.5)
    weights, ids = moe.route_grouped_sigmoid_topk(logits, bias, 3, 4, 2, True, 2.5, "one")
    assert torch.equal(weights[:, :3], plain_w) and torch.equal(ids[:, :3], plain_ids)
    assert (weights[:, 3] == 1).all() and (ids[:, 3] == 16).all()


def test_strided_fused_gate_output():
    """The gate GEMM's output as a column slice of a wider buffer: strides are honoured and
    the gate logit is read from the last column of the slice, not of the buffer."""
    wide = distinct_logits(3, 40, torch.bfloat16, seed=23)
    view = wide[:, 4:37]  # 32 routed logits + the gate column, row stride 40
    weights, ids = softmax_topk_triton(view, 5, True, "sigmoid_last_logit")
    ref_w, ref_ids = softmax_topk_ref(view.contiguous(), 5, True, "sigmoid_last_logit")
    assert torch.equal(ids, ref_ids) and torch.equal(weights[:, :5], ref_w[:, :5])
    check_shared_column("strided", weights, ids, view, "sigmoid_last_logit", 32, 5, ref_w[:, 5:])


def test_layer_routers_on_cpu_are_the_references():
    logits = distinct_logits(4, 17, torch.bfloat16, seed=24, device="cpu")
    for mode in MODES:
        got = moe.route_softmax_topk(logits, 3, True, mode)
        want = softmax_topk_ref(logits, 3, True, mode)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    # float64 (the schedule-invariance tests' dtype) stays float64, sigmoid included.
    logits64 = logits.double()
    weights, ids = moe.route_softmax_topk(logits64, 3, True, "sigmoid_last_logit")
    assert weights.dtype == torch.float64
    assert torch.equal(weights[:, 3], torch.sigmoid(logits64[:, 16]))


def test_bad_shared_expert_weight_is_named():
    logits = distinct_logits(2, 8, torch.float32, seed=25)
    assert SHARED_EXPERT_WEIGHTS == (None, "sigmoid_last_logit", "one")
    for call in (
        lambda: softmax_topk_triton(logits, 2, True, "sigmoid"),
        lambda: sigmoid_topk_triton(logits, None, 2, True, 1.0, "ones"),
        lambda: softmax_topk_ref(logits, 2, True, 1.0),
        lambda: moe.route_grouped_sigmoid_topk(logits.cpu(), None, 2, 1, 1, True, 1.0, "x"),
    ):
        with pytest.raises(ValueError, match="^shared_expert_weight"):
            call()
    # The gate column is not an expert: top_k counts the E routed ones.
    with pytest.raises(ValueError, match="^top_k"):
        softmax_topk_triton(logits, 8, True, "sigmoid_last_logit")


def test_empty_batch():
    for mode in MODES:
        weights, ids = softmax_topk_triton(torch.empty(0, 9, device=DEVICE), 2, True, mode)
        assert weights.shape == ids.shape == (0, 3)


# ------------------------------------------------------------------------------------- gpu


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 8, 4096])
def test_gpu_real_routers_with_shared_route_and_cuda_graph(tokens):
    """Qwen3-Next (512 experts + gate column, top-10, bf16) and Kimi-Linear (256, top-8,
    bias, scaled, weight 1), compiled; the softmax router replayed from a CUDA graph."""
    routed = distinct_logits(tokens, 512, torch.bfloat16, seed_of("gpu shared", tokens))
    logits = with_gate(routed, "sigmoid_last_logit", seed_of("gpu gate", tokens))
    weights, ids = softmax_topk_triton(logits, 10, True, "sigmoid_last_logit")
    ref_w, ref_ids = softmax_topk_ref(logits, 10, True, "sigmoid_last_logit")
    assert torch.equal(ids, ref_ids)
    plain = softmax_topk_triton(routed, 10, True)
    assert torch.equal(weights[:, :10], plain[0]) and torch.equal(ids[:, :10], plain[1])
    check_shared_column(
        "gpu qwen3-next", weights, ids, logits, "sigmoid_last_logit", 512, 10, ref_w[:, 10:]
    )
    layer = moe.route_softmax_topk(logits, 10, True, "sigmoid_last_logit")
    assert torch.equal(layer[0], weights) and torch.equal(layer[1], ids)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_w, graph_ids = softmax_topk_triton(logits, 10, True, "sigmoid_last_logit")
    fresh = distinct_logits(tokens, 512, torch.bfloat16, seed_of("gpu fresh", tokens))
    logits.copy_(with_gate(fresh, "sigmoid_last_logit", seed_of("gpu gate 2", tokens)))
    graph.replay()
    torch.cuda.synchronize()
    eager = softmax_topk_triton(logits, 10, True, "sigmoid_last_logit")
    assert torch.equal(graph_w, eager[0]) and torch.equal(graph_ids, eager[1])

    kimi = distinct_logits(tokens, 256, torch.float32, seed_of("gpu kimi shared", tokens))
    bias = case_bias(256, seed_of("gpu kimi bias", tokens), True)
    weights, ids = sigmoid_topk_triton(kimi, bias, 8, True, 2.446, "one")
    plain = sigmoid_topk_triton(kimi, bias, 8, True, 2.446)
    assert torch.equal(weights[:, :8], plain[0]) and torch.equal(ids[:, :8], plain[1])
    check_shared_column("gpu kimi", weights, ids, kimi, "one", 256, 8, None)
