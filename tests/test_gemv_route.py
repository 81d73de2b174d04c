"""The softmax top-k router in the router GEMV's launch (`gemv_triton.gemv_route_triton`,
`rms_norm_gemv_route_triton`): the last program to store its logits routes every row.

The fused launch must be BITWISE the GEMV launch (with the norm prologue where given)
followed by the router launch (`moe_router_triton.softmax_topk_triton`): the logits, the
weights and the ids. Without CUDA the kernels run in Triton's CPU interpreter, which runs
programs one after another, so the last program to arrive is the last one; the
`gpu`-marked tests run the cross-program order compiled, at Qwen3-Next's router shape,
in a CUDA graph and in many back-to-back launches. torch.empty is NaN-filled while a test
runs (test_gemv's autouse fixture), so an element left unwritten shows.
"""

from __future__ import annotations

import pytest
import torch

from kvloom.kernels import gemv_triton as gt
from kvloom.kernels.gemv_triton import (
    GemvPlan,
    gemv_route_triton,
    gemv_triton,
    rms_norm_gemv_route_triton,
    rms_norm_gemv_triton,
)
from kvloom.kernels.moe_router_triton import softmax_topk_triton
from tests.kernel_env import gpu, needs_cuda
from tests.test_gemv import nan_filled_empty, randn  # noqa: F401 (autouse)
from tests.test_moe_shared_expert_fold import FOLDED_QWEN3_NEXT, PROMPT
from tests.test_oracle_qwen3_next import save_tiny
from tests.test_rms_norm_gemv import Counter, _force_decode_kernels

EPS = 1e-6
ONE_WARP = GemvPlan(4, 64, 1, 2)  # the router launch's warps at <= 1024 experts: fuses
SHARED = (None, "sigmoid_last_logit", "one")


def make_router(rows, experts, k, *, shared, seed, dtype=torch.bfloat16):
    """x [rows, k] (rows strided), the router weight [experts (+ 1 gate row), k]."""
    x = randn(rows, k + 5, seed=seed, dtype=dtype, scale=2.0)[:, :k]
    width = experts + (shared == "sigmoid_last_logit")
    w = randn(width, k, seed=seed + 1, dtype=dtype, scale=k**-0.5)
    return x, w


def unfused_launches(monkeypatch):
    """Fail the test if the router launch runs: the fused path must not take it."""

    def no_router_launch(*args, **kwargs):
        raise AssertionError("the router ran as its own launch")

    monkeypatch.setattr(gt, "softmax_topk_triton", no_router_launch)


def check_routes(got, want, name):
    for a, b, what in zip(got, want, ("logits", "weights", "ids")):
        assert not (a.is_floating_point() and torch.isnan(a).any()), f"{name}: NaN in {what}"
        assert torch.equal(a, b), f"{name}: {what} differ from the two launches"


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("shared", SHARED)
@pytest.mark.parametrize("renormalize", [False, True])
def test_fused_router_equals_gemv_then_router_bitwise(monkeypatch, rows, shared, renormalize):
    """40 experts, top 6 (+ a shared route), K = 200: one launch, the two launches' bits."""
    x, w = make_router(rows, 40, 200, shared=shared, seed=rows + 7 * len(str(shared)))
    want_logits = gemv_triton(x, w, plan=ONE_WARP)
    want = (want_logits, *softmax_topk_triton(want_logits, 6, renormalize, shared))
    unfused_launches(monkeypatch)
    got = gemv_route_triton(
        x, w, None, top_k=6, renormalize=renormalize, shared_expert_weight=shared, plan=ONE_WARP
    )
    check_routes(got, want, f"rows={rows} shared={shared} renormalize={renormalize}")
    assert int(gt.route_counter(x.device)[0]) == 0, "the counter must be left at 0"


def test_norm_prologue_with_router_bitwise(monkeypatch):
    """With the RMSNorm prologue: logits, new residual, normed rows and routes are those
    of rms_norm_gemv_triton followed by the router launch."""
    x, w = make_router(2, 40, 200, shared="sigmoid_last_logit", seed=31)
    res = randn(2, 200, seed=32, dtype=torch.bfloat16)
    norm_w = (randn(200, seed=33, dtype=torch.float32, scale=0.3) + 1.0).to(torch.bfloat16)
    logits, new_res, normed = rms_norm_gemv_triton(
        x, res, norm_w, EPS, w, write_normed=True, plan=ONE_WARP
    )
    want = (logits, new_res, normed, *softmax_topk_triton(logits, 6, True, "sigmoid_last_logit"))
    unfused_launches(monkeypatch)
    got = rms_norm_gemv_route_triton(
        x, res, norm_w, EPS, w, None, top_k=6, renormalize=True,
        shared_expert_weight="sigmoid_last_logit", write_normed=True, plan=ONE_WARP,
    )  # fmt: skip
    for a, b, what in zip(got, want, ("logits", "residual", "normed", "weights", "ids")):
        assert torch.equal(a, b), what


@pytest.mark.parametrize(
    "plan", [GemvPlan(4, 64, 2, 2), GemvPlan(4, 64, 1, 2, split_k=2)], ids=["2 warps", "split-K"]
)
def test_plans_the_epilogue_cannot_match_take_two_launches(monkeypatch, plan):
    """A plan whose warps differ from the router launch's, or that splits K, runs the
    GEMV and the router as two launches (the router launch is seen), same results."""
    x, w = make_router(1, 40, 200, shared=None, seed=41)
    want_logits = gemv_triton(x, w, plan=plan)
    want = (want_logits, *softmax_topk_triton(want_logits, 6, False))
    calls = []

    def router_launch(*args, **kwargs):
        calls.append(1)
        return softmax_topk_triton(*args, **kwargs)

    monkeypatch.setattr(gt, "softmax_topk_triton", router_launch)
    got = gemv_route_triton(x, w, None, top_k=6, renormalize=False, plan=plan)
    check_routes(got, want, plan.name)
    assert calls == [1]


def test_ties_and_nan_rows_follow_the_router(monkeypatch):
    """A row whose logits tie (an all-zero input row: every logit 0) picks the lowest ids;
    a NaN input row gets NaN weights; as the router launch does."""
    x, w = make_router(2, 40, 128, shared=None, seed=51)
    x = x.clone()
    x[0] = 0.0
    x[1, 3] = float("nan")
    want_logits = gemv_triton(x, w, plan=ONE_WARP)
    want = (want_logits, *softmax_topk_triton(want_logits, 4, True))
    unfused_launches(monkeypatch)
    got = gemv_route_triton(x, w, None, top_k=4, renormalize=True, plan=ONE_WARP)
    assert torch.equal(got[2][0], torch.arange(4, device=x.device))
    assert torch.isnan(got[1][1]).all()
    assert torch.equal(got[2], want[2]) and torch.equal(got[1][0], want[1][0])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(top_k=41, renormalize=False), "top_k"),
        (dict(top_k=4, renormalize=1), "renormalize"),
        (dict(top_k=4, renormalize=False, shared_expert_weight="half"), "shared_expert_weight"),
        (dict(top_k=4, renormalize=False, picks_per_round=3), "picks_per_round"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, field):
    x, w = make_router(1, 40, 64, shared=None, seed=61)
    with pytest.raises(ValueError, match=field):
        gemv_route_triton(x, w, None, plan=ONE_WARP, **kwargs)


# ---------------------------------------------------------------- on the GPU


@gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 2])
def test_gpu_qwen3_next_router_bitwise(monkeypatch, rows):
    """Qwen3-Next's router (512 experts + the shared gate, K = 2048, top 10, renormalized)
    with the chosen plan, with and without the norm prologue: the fused launch's bits."""
    x, w = make_router(rows, 512, 2048, shared="sigmoid_last_logit", seed=71 + rows)
    want_logits = gemv_triton(x, w)
    want = (want_logits, *softmax_topk_triton(want_logits, 10, True, "sigmoid_last_logit"))
    unfused_launches(monkeypatch)
    args = dict(top_k=10, renormalize=True, shared_expert_weight="sigmoid_last_logit")
    check_routes(gemv_route_triton(x, w, None, **args), want, f"gpu rows={rows}")


@gpu
@needs_cuda
def test_gpu_back_to_back_launches_and_graph_replays():
    """The counter's cross-program order, compiled: 50 launches queued back to back, then
    a CUDA graph of 10 launches replayed on new inputs, each launch's routes equal to the
    two launches' on its input, and the counter 0 after."""
    args = dict(top_k=10, renormalize=True, shared_expert_weight="sigmoid_last_logit")
    inputs = [
        make_router(1, 512, 2048, shared=args["shared_expert_weight"], seed=s) for s in range(50)
    ]
    wants = []
    for x, w in inputs:
        logits = gemv_triton(x, w)
        wants.append((logits, *softmax_topk_triton(logits, 10, True, "sigmoid_last_logit")))
    outs = [gemv_route_triton(x, w, None, **args) for x, w in inputs]
    torch.cuda.synchronize()
    for i, (got, want) in enumerate(zip(outs, wants)):
        check_routes(got, want, f"launch {i}")
    w = inputs[0][1]
    static_x = inputs[0][0].clone()
    gemv_route_triton(static_x, w, None, **args)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = [gemv_route_triton(static_x, w, None, **args) for _ in range(10)]
    for x, _ in inputs[1:4]:
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        logits = gemv_triton(x, w)
        want = (logits, *softmax_topk_triton(logits, 10, True, "sigmoid_last_logit"))
        for got in captured:
            check_routes(got, want, "graph replay")
    assert int(gt.route_counter(static_x.device)[0]) == 0


# ---------------------------------------------------------------- a model's decode


@pytest.fixture(scope="module")
def folded_src(tmp_path_factory, demo_tokenizer_dir):
    """A tiny Qwen3-Next checkpoint whose MoE layers fold their shared expert."""
    return save_tiny(
        tmp_path_factory.mktemp("qwen3-next-fold"), demo_tokenizer_dir, FOLDED_QWEN3_NEXT
    )


@pytest.mark.parametrize("norm_gemv", [False, True], ids=["norm launch", "norm prologue"])
def test_folded_qwen3_next_decode_is_bitwise_the_same_routed_in_the_gemv(
    monkeypatch, folded_src, norm_gemv
):
    """A tiny bf16 Qwen3-Next with folded shared experts, its decode kernels interpreted
    as on a GPU: with router_gemv on (the default), every MoE layer's router runs in its
    GEMV's launch at each one-row step (never at longer ones), and the greedy tokens and logprobs are
    those of the router launch after the GEMV (the router kernel in both runs), with the
    norm as its own launch or in the GEMV's prologue."""
    from kvloom import LLM
    from kvloom.contracts.sampling_params import SamplingParams
    from kvloom.workers.models import qwen3_next

    def triton_router(logits, top_k, renormalize, shared_expert_weight=None):
        return softmax_topk_triton(logits, top_k, renormalize, shared_expert_weight)

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5)
    results = {}
    for fused in (False, True):
        with monkeypatch.context() as patch:
            _force_decode_kernels(patch, fuse=norm_gemv)
            # One warp, as the router launch at <= 1024 experts: the epilogue can run.
            patch.setattr(gt, "default_gemv_plan", lambda n, k: GemvPlan(64, 128, 1, 1))
            patch.setattr(qwen3_next, "route_softmax_topk", triton_router)
            patch.setenv("KVLOOM_FUSED", "norm_gemv" if norm_gemv else "")
            patch.setenv("KVLOOM_UNFUSED", "" if fused else "router_gemv")
            routed = Counter(patch, gt, "gemv_route_triton")
            llm = LLM(str(folded_src), dtype="bfloat16", progress=False, enforce_eager=True)
            model = llm.engine.executor.worker.runner.model
            moe_layers = sum(
                isinstance(m, qwen3_next.Qwen3NextSparseMoe) and m.folded_shared_expert
                for m in model.modules()
            )
            rows = []
            model.model.register_forward_pre_hook(
                lambda module, args, rows=rows: rows.append(args[0].shape[0])
            )
            out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
            results[fused] = (out, routed.calls, rows)
    (plain, plain_calls, _), (got, fused_calls, rows) = results[False], results[True]
    assert moe_layers > 0 and plain_calls == 0
    one_row = sum(n == 1 for n in rows)  # the decodes (and a one-token prefill chunk)
    assert one_row >= params.max_tokens - 1 and max(rows) > 2
    assert fused_calls == moe_layers * one_row
    assert got.token_ids == plain.token_ids
    assert got.logprobs == plain.logprobs
