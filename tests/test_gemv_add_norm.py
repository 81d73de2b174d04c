"""The residual add and RMSNorm in a projection's GEMV launch (`gemv_triton.
gemv_add_rms_norm_triton`, KVLOOM_FUSED=linear_add_norm): the last program to store its
features normalises the rows.

The fused launch must be BITWISE the GEMV launch followed by the norm launch
(`rms_norm_triton(y, norm_weight, eps, residual, weight_offset)`): the normed rows and
the new residual. Without CUDA the kernels run in Triton's CPU interpreter, which runs
programs one after another, so the last program to arrive is the last one; the
`gpu`-marked tests run the cross-program order compiled, at the real output projections'
shapes, in a CUDA graph and in many back-to-back launches. torch.empty is NaN-filled
while a test runs (test_gemv's autouse fixture), so an element left unwritten shows.
"""

from __future__ import annotations

import pytest
import torch

from kvloom.kernels import gemv_triton as gt
from kvloom.kernels import ops
from kvloom.kernels import rms_norm_triton as rt
from kvloom.kernels.gemv_triton import GemvPlan, gemv_add_rms_norm_triton, gemv_triton
from kvloom.kernels.rms_norm_triton import rms_norm_triton
from tests.engine_helpers import record_steps
from tests.kernel_env import DEVICE, gpu, needs_cuda
from tests.test_gemv import nan_filled_empty, randn  # noqa: F401 (autouse)
from tests.test_rms_norm_gemv import Counter, _force_decode_kernels

EPS = 1e-6
PLAN = GemvPlan(16, 64, 4, 2)  # one K range: the epilogue runs


def make_case(rows, n, k, *, seed, dtype=torch.bfloat16, bias=False):
    """x [rows, k] (rows strided), weight [n, k], bias, residual [rows, n], norm weight."""
    x = randn(rows, k + 3, seed=seed, dtype=dtype, scale=2.0)[:, :k]
    w = randn(n, k, seed=seed + 1, dtype=dtype, scale=k**-0.5)
    b = randn(n, seed=seed + 2, dtype=dtype) if bias else None
    residual = randn(rows, n, seed=seed + 3, dtype=dtype, scale=3.0)
    norm_w = randn(n, seed=seed + 4, dtype=dtype, scale=0.3) + 1
    return x, w, b, residual, norm_w


def two_launches(x, w, b, residual, norm_w, offset, plan):
    return rms_norm_triton(gemv_triton(x, w, b, plan=plan), norm_w, EPS, residual, offset)


def no_norm_launch(monkeypatch):
    """Fail the test if the norm launch runs: the fused path must not take it."""

    def refuse(*args, **kwargs):
        raise AssertionError("the norm ran as its own launch")

    monkeypatch.setattr(gt, "rms_norm_triton", refuse)


def check(got, want, name):
    for a, b, what in zip(got, want, ("normed", "residual"), strict=True):
        assert not torch.isnan(a).any(), f"{name}: NaN in {what}"
        assert torch.equal(a, b), f"{name}: {what} differs from the two launches"


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["weight", "zero-centred"])
def test_fused_equals_gemv_then_norm_bitwise(monkeypatch, rows, dtype, offset):
    """N = 200 (a ragged last tile, 13 programs), K = 96: the normed rows and the new
    residual, bit for bit, with a bias, and the counter left at 0."""
    x, w, b, residual, norm_w = make_case(rows, 200, 96, seed=rows, dtype=dtype, bias=True)
    want = two_launches(x, w, b, residual, norm_w, offset, PLAN)
    no_norm_launch(monkeypatch)
    got = gemv_add_rms_norm_triton(x, w, b, residual, norm_w, EPS, weight_offset=offset, plan=PLAN)
    check(got, want, f"rows={rows}")
    assert int(gt.add_norm_counter(x.device)[0]) == 0, "the counter must be left at 0"


def test_rows_longer_than_the_norm_lanes():
    """N = 1,500 > 1,024 lanes: the epilogue's chunks and the norm's sum of squares over
    two lane passes; the default plan."""
    x, w, b, residual, norm_w = make_case(1, 1500, 64, seed=11)
    plan = gt.choose_gemv_plan(1, 1500, 64, x.dtype)
    want = two_launches(x, w, b, residual, norm_w, 0.0, plan)
    check(gemv_add_rms_norm_triton(x, w, b, residual, norm_w, EPS), want, "N=1500")


@pytest.mark.parametrize("plan", [GemvPlan(16, 64, 4, 2, 2), None], ids=["split-k", "3 rows"])
def test_what_the_epilogue_cannot_serve_takes_two_launches(monkeypatch, plan):
    """A plan with two K ranges, or more rows than ADD_NORM_GEMV_MAX_M: the GEMV and the
    norm launch, the same results."""
    rows = 3 if plan is None else 1
    plan = plan or PLAN
    x, w, b, residual, norm_w = make_case(rows, 72, 128, seed=21)
    want = two_launches(x, w, b, residual, norm_w, 0.0, plan)
    norms = Counter(monkeypatch, gt, "rms_norm_triton")
    got = gemv_add_rms_norm_triton(x, w, b, residual, norm_w, EPS, plan=plan)
    check(got, want, "two launches")
    assert norms.calls == 1


def test_launch_refuses_the_epilogue_with_another_fusion():
    x, w, _, residual, norm_w = make_case(1, 64, 64, seed=31)
    epilogue = gt.AddNormEpilogue(
        norm_w, EPS, 0.0, residual, torch.empty_like(residual), torch.empty_like(residual),
        gt.add_norm_counter(x.device),
    )  # fmt: skip
    out = torch.empty(1, 32, dtype=x.dtype, device=x.device)
    with pytest.raises(ValueError, match="add_norm: the epilogue needs split_k = 1"):
        gt.launch_gemv(x, w, None, out, PLAN, silu_and_mul=True, add_norm=epilogue)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(residual=torch.zeros(1, 63, dtype=torch.bfloat16, device=DEVICE)), "residual"),
        (dict(residual=torch.zeros(1, 64, dtype=torch.float16, device=DEVICE)), "residual"),
        (dict(norm_w=torch.ones(63, dtype=torch.bfloat16, device=DEVICE)), "norm_weight"),
        (dict(norm_w=torch.ones(64, dtype=torch.float32, device=DEVICE)), "norm_weight"),
        (dict(x=torch.zeros(9, 64, dtype=torch.bfloat16, device=DEVICE)), "x"),
    ],
)
def test_bad_arguments_name_the_field(change, field):
    x, w, b, residual, norm_w = make_case(1, 64, 64, seed=41)
    args = dict(x=x, w=w, b=b, residual=residual, norm_w=norm_w) | change
    with pytest.raises(ValueError, match=f"^{field}"):
        gemv_add_rms_norm_triton(
            args["x"], args["w"], args["b"], args["residual"], args["norm_w"], EPS
        )


@pytest.mark.parametrize(
    "setting, fuses",
    [("KVLOOM_FUSED=linear_add_norm", True), ("", False), ("two rows", False)],
)
def test_ops_fuses_only_when_named_at_one_row(monkeypatch, setting, fuses):
    """ops.linear_add_rms_norm: the fused launch where the GEMV would run on one row with
    KVLOOM_FUSED naming linear_add_norm (opt-in until timed); None elsewhere."""
    monkeypatch.setattr(ops, "use_triton", lambda t: True)  # the Triton paths, interpreted
    monkeypatch.delenv("KVLOOM_UNFUSED", raising=False)
    monkeypatch.setenv("KVLOOM_FUSED", "" if setting == "" else "linear_add_norm")
    rows = 2 if setting == "two rows" else 1
    x, w, _, residual, norm_w = make_case(rows, 64, 64, seed=51)
    got = ops.linear_add_rms_norm(x, w, None, residual, norm_w, EPS, 1.0)
    if not fuses:
        assert got is None
        return
    check(got, two_launches(x, w, None, residual, norm_w, 1.0, None), "ops")


# ---------------------------------------------------------------- a model's decode


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_decode_is_bitwise_the_same_normed_in_the_projection(
    monkeypatch, tiny_model, hybrid_model, arch
):
    """A tiny bf16 model's greedy decode, its decode kernels interpreted as on a GPU: with
    linear_add_norm on, every layer's output projection (attention o_proj; Qwen3-Next's
    GDN out_proj too) runs with the residual add and the post norm in its launch at each
    one-row step (never at longer ones), and the tokens, their logprobs and the final
    norm's inputs at every step are those of the projection and norm launches."""
    from kvloom import LLM
    from kvloom.contracts.sampling_params import SamplingParams

    path = tiny_model("llama") if arch == "llama" else hybrid_model(arch)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5)
    results = {}
    for fused in (False, True):
        with monkeypatch.context() as patch:
            _force_decode_kernels(patch, fuse=False)
            patch.setenv("KVLOOM_FUSED", "linear_add_norm" if fused else "")
            calls = Counter(patch, gt, "gemv_add_rms_norm_triton")
            norms = Counter(patch, rt, "rms_norm_triton")
            llm = LLM(str(path), dtype="bfloat16", progress=False, enforce_eager=True)
            model = llm.engine.executor.worker.runner.model
            states, rows = record_steps(model)
            out = llm.generate([5, 17, 33, 9, 61, 7], params, use_tqdm=False)[0].outputs[0]
            layers = len(model.model.layers)
            results[fused] = (out, states, calls.calls, norms.calls, rows, layers)
    plain, plain_states, plain_calls, plain_norms, _, _ = results[False]
    got, got_states, fused_calls, fused_norms, rows, layers = results[True]
    one_row = sum(n == 1 for n in rows)
    assert one_row >= params.max_tokens - 1 and max(rows) > 2
    assert plain_calls == 0 and fused_calls == layers * one_row
    assert plain_norms - fused_norms == layers * one_row  # each replaced a norm launch
    for step, (want, have) in enumerate(zip(plain_states, got_states, strict=True)):
        assert all(torch.equal(a, b) for a, b in zip(want, have, strict=True)), step
    assert got.token_ids == plain.token_ids
    assert got.logprobs == plain.logprobs


# ---------------------------------------------------------------- on the GPU


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "n, k, offset",
    [(4096, 4096, 0.0), (2048, 4096, 1.0), (2048, 2048, 1.0), (2304, 4096, 0.0)],
    ids=["qwen3-8b o_proj", "qwen3-next out_proj", "qwen3-next-16l o_proj", "kimi o_proj"],
)
def test_gpu_output_projections_bitwise(monkeypatch, n, k, offset):
    """Real output projections with their chosen plans: the fused launch's bits (where
    the plan has one K range; else the two launches, also checked)."""
    x, w, _, residual, norm_w = make_case(1, n, k, seed=n + k)
    plan = gt.choose_gemv_plan(1, n, k, x.dtype)
    want = two_launches(x, w, None, residual, norm_w, offset, plan)
    if plan.split_k == 1:
        no_norm_launch(monkeypatch)
    got = gemv_add_rms_norm_triton(x, w, None, residual, norm_w, EPS, weight_offset=offset)
    check(got, want, f"gpu {n}x{k}")


@gpu
@needs_cuda
def test_gpu_back_to_back_launches_and_graph_replays():
    """The counter's cross-program order, compiled: 50 launches queued back to back, then
    a CUDA graph of 10 launches replayed on new inputs, each equal to the two launches on
    its input, and the counter 0 after."""
    cases = [make_case(1, 2048, 4096, seed=s) for s in range(50)]
    plan = GemvPlan(16, 128, 4, 4)
    wants = [two_launches(*case[:4], case[4], 1.0, plan) for case in cases]
    outs = [
        gemv_add_rms_norm_triton(x, w, b, r, nw, EPS, weight_offset=1.0, plan=plan)
        for x, w, b, r, nw in cases
    ]
    torch.cuda.synchronize()
    for i, (got, want) in enumerate(zip(outs, wants, strict=True)):
        check(got, want, f"launch {i}")
    x0, w, _, r0, nw = cases[0]
    static_x, static_r = x0.clone(), r0.clone()
    args = dict(weight_offset=1.0, plan=plan)
    gemv_add_rms_norm_triton(static_x, w, None, static_r, nw, EPS, **args)  # compiled first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = [
            gemv_add_rms_norm_triton(static_x, w, None, static_r, nw, EPS, **args)
            for _ in range(10)
        ]
    for x, _, _, r, _ in cases[1:4]:
        static_x.copy_(x)
        static_r.copy_(r)
        graph.replay()
        torch.cuda.synchronize()
        want = two_launches(x, w, None, r, nw, 1.0, plan)
        for got in captured:
            check(got, want, "graph replay")
    assert int(gt.add_norm_counter(static_x.device)[0]) == 0
