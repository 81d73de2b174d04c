"""RMSNorm (with the residual add) fused into the prologue of the decode GEMV that reads it
(`gemv_triton.rms_norm_gemv_triton`, `ops.rms_norm_linear`, `norm_linear`).

The fused launch must be BITWISE the norm launch (`rms_norm_triton`) followed by the GEMV
launch (`gemv_triton`, or `gemv_silu_and_mul_triton` for a gated MLP's gate_up) with the
same plan: the normed values fed to the dot, the new residual and the normed rows it
stores. Without CUDA the kernels run in Triton's CPU interpreter (bfloat16 rounded as the
GPU rounds it, tests/triton_interpret/conftest.py) at small shapes; with CUDA the same
tests run compiled, and the `gpu`-marked ones add the Qwen3-8B / Qwen3-Next shapes and
CUDA-graph capture. torch.empty is NaN-filled while a test runs (test_gemv's autouse
fixture), so an element left unwritten shows.
"""

from __future__ import annotations

import pytest
import torch

from kvloom.kernels import dispatch, ops
from kvloom.kernels import gemv_triton as gt
from kvloom.kernels import rms_norm_triton as rt
from kvloom.kernels.gemv import NORM_GEMV_MAX_M, rms_norm_gemv_ref
from kvloom.kernels.gemv_triton import (
    GemvPlan,
    gemv_silu_and_mul_triton,
    gemv_triton,
    rms_norm_gemv_triton,
)
from kvloom.kernels.rms_norm_triton import rms_norm_triton
from tests.engine_helpers import record_steps
from tests.kernel_env import CUDA, DEVICE, gpu, needs_cuda
from tests.test_gemv import nan_filled_empty, randn  # noqa: F401 (autouse)

# norm_gemv is opt-in (contracts/envs.py OPT_IN_FUSIONS): these tests check it.
pytestmark = pytest.mark.usefixtures("norm_gemv_on")


EPS = 1e-6
GATED = "gemv_silu_and_mul_triton"
# The chosen plan, a plain plan whose tiles do not divide N, and split-K plans (the norm
# then runs in the partial-sum launch; each K range's programs store their columns).
PLANS = (
    None,
    GemvPlan(8, 128, 2, 2),
    GemvPlan(4, 64, 2, 3, split_k=3),
    GemvPlan(16, 192, 4, 2, split_k=2),
)


def make_inputs(rows, n, k, dtype, seed, *, offset=0.0, residual=True, bias=False, row_pad=3):
    """x (rows strided by k + row_pad), residual, norm weight (around 1, or around 0 for
    a zero-centred norm: weight_offset 1), weight [n, k] scaled for O(1) outputs, bias."""
    x = randn(rows, k + row_pad, seed=seed, dtype=dtype, scale=2.0)[:, :k]
    res = randn(rows, k, seed=seed + 1, dtype=dtype) if residual else None
    norm_w = randn(k, seed=seed + 2, dtype=dtype, scale=0.3) + (0.0 if offset else 1.0)
    w = randn(n, k, seed=seed + 3, dtype=dtype, scale=k**-0.5)
    b = randn(n, seed=seed + 4, dtype=dtype) if bias else None
    return x, res, norm_w.to(dtype), w, b


def two_launches(x, res, norm_w, w, b, *, offset, silu, plan):
    """What the decoder layer ran before: the norm launch, then the GEMV launch."""
    normed, new_res = rms_norm_triton(x, norm_w, EPS, res, offset)
    gemv = gemv_silu_and_mul_triton if silu else gemv_triton
    return gemv(normed, w, b, plan=plan), new_res, normed


def check_fused(name, x, res, norm_w, w, b, *, offset=0.0, silu=False, plan=None, normed=True):
    y, new_res, out_normed = rms_norm_gemv_triton(
        x, res, norm_w, EPS, w, b, weight_offset=offset, silu_and_mul=silu,
        write_normed=normed, plan=plan,
    )  # fmt: skip
    want_y, want_res, want_normed = two_launches(
        x, res, norm_w, w, b, offset=offset, silu=silu, plan=plan
    )
    assert not torch.isnan(y).any(), f"{name}: NaN in the output (an element left unwritten)"
    assert torch.equal(y, want_y), f"{name}: y differs from norm + GEMV launches"
    if res is None:
        assert new_res is None, name
    else:
        assert torch.equal(new_res, want_res), f"{name}: residual"
        assert torch.equal(new_res, x + res), f"{name}: residual is not x + residual"
    if normed:
        assert torch.equal(out_normed, want_normed), f"{name}: normed rows"
    else:
        assert out_normed is None, name
    # And near the torch reference: the normed rows within one ulp (the norm's float32
    # statistic may differ from torch's in its last bits); y, for half dtypes, within a
    # few ulps (that ulp carried through the dot; the GEMVs' own accuracy against the
    # reference, float32 sums of any K included, is test_gemv's).
    ref_y, _, ref_normed = rms_norm_gemv_ref(
        x, res, norm_w, EPS, w, b, weight_offset=offset, silu_and_mul=silu
    )
    tol = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-20}[x.dtype]
    torch.testing.assert_close(want_normed.float(), ref_normed.float(), rtol=tol, atol=tol)
    if x.dtype != torch.float32:
        torch.testing.assert_close(y.float(), ref_y.float(), rtol=4 * tol, atol=4 * tol)


# ---------------------------------------------------------------- the kernel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2])
def test_fused_equals_norm_then_gemv_bitwise(dtype, rows):
    """K = 200 (not a multiple of 64 or of any block_k), N = 37, strided x rows; every plan,
    with and without weight_offset, with and without the normed rows stored. float32
    (not dispatched, but supported) shows the statistic's last bits: the two kernels
    must sum the squares in one order."""
    for index, plan in enumerate(PLANS):
        offset = float(index % 2)
        case = make_inputs(rows, 37, 200, dtype, seed=10 * rows + index, offset=offset)
        name = f"{dtype} rows={rows} offset={offset} {plan.name if plan else 'chosen'}"
        check_fused(name, *case, offset=offset, plan=plan, normed=index < 2)


@pytest.mark.parametrize("rows", [1, 2])
def test_silu_variant_equals_norm_then_gated_gemv_bitwise(rows):
    """norm -> gate_up GEMV -> silu_and_mul in one launch (split-K: two), I = 37."""
    for index, plan in enumerate(PLANS):
        offset = float(index % 2)
        case = make_inputs(rows, 2 * 37, 200, torch.bfloat16, seed=40 + index, offset=offset)
        name = f"silu rows={rows} offset={offset} {plan.name if plan else 'chosen'}"
        check_fused(name, *case, offset=offset, silu=True, plan=plan, normed=index % 2 == 0)


def test_first_layer_without_residual_and_with_bias():
    """residual None (a model's first layer): no residual is written; a bias is added."""
    for plan in (None, PLANS[2]):
        case = make_inputs(2, 37, 130, torch.bfloat16, seed=60, residual=False, bias=True)
        check_fused(f"no residual {plan}", *case, plan=plan)
        check_fused(f"no residual silu {plan}", *case[:3], case[3][:36], case[4][:36],
                    silu=True, plan=plan)  # fmt: skip


def test_row_longer_than_the_sum_lanes():
    """K = 1100 > 1024 lanes: the sum of squares takes two steps per lane."""
    case = make_inputs(1, 20, 1100, torch.bfloat16, seed=70, offset=1.0)
    check_fused("K=1100", *case, offset=1.0, plan=GemvPlan(16, 128, 4, 2))


def test_rows_are_independent_bitwise():
    """Row 1 of a two-row launch equals a one-row launch on it (invariant 7)."""
    x, res, norm_w, w, _ = make_inputs(2, 37, 200, torch.bfloat16, seed=80)
    both = rms_norm_gemv_triton(x, res, norm_w, EPS, w, write_normed=True)
    one = rms_norm_gemv_triton(x[1:], res[1:], norm_w, EPS, w, write_normed=True)
    for a, b in zip(both, one):
        assert torch.equal(a[1:], b)


def test_bad_input_names_the_field():
    x, res, norm_w, w, b = make_inputs(2, 8, 16, torch.bfloat16, seed=90, bias=True)
    with pytest.raises(ValueError, match="x: 3 rows"):
        rms_norm_gemv_triton(torch.ones(3, 16, device=DEVICE, dtype=x.dtype), None, norm_w, EPS, w)
    with pytest.raises(ValueError, match="residual: expected"):
        rms_norm_gemv_triton(x, res[:1], norm_w, EPS, w)
    with pytest.raises(ValueError, match="residual: dtype"):
        rms_norm_gemv_triton(x, res.half(), norm_w, EPS, w)
    with pytest.raises(ValueError, match="norm_weight: expected"):
        rms_norm_gemv_triton(x, res, norm_w[:15], EPS, w)
    with pytest.raises(ValueError, match="norm_weight: dtype"):
        rms_norm_gemv_triton(x, res, norm_w.float(), EPS, w)
    with pytest.raises(ValueError, match="weight: expected \\[gate; up\\]"):
        rms_norm_gemv_triton(x, res, norm_w, EPS, w[:7], silu_and_mul=True)
    with pytest.raises(ValueError, match="weight: needs at least one row"):
        rms_norm_gemv_triton(x, res, norm_w, EPS, w[:0])
    with pytest.raises(ValueError, match="bias"):
        rms_norm_gemv_triton(x, res, norm_w, EPS, w, b[:7])


# ---------------------------------------------------------------- the dispatch


class Counter:
    """Wraps a module function and counts its calls."""

    def __init__(self, monkeypatch, module, name):
        self.calls = 0
        real = getattr(module, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


@pytest.mark.parametrize("mode", ["default", "KVLOOM_NO_GEMV", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, NORM_GEMV_MAX_M, NORM_GEMV_MAX_M + 1])
@pytest.mark.parametrize("silu", [False, True])
def test_ops_fuse_exactly_where_the_plain_gemv_runs(monkeypatch, mode, dtype, rows, silu):
    """ops.rms_norm_linear takes the fused launch exactly where the projection alone would
    take the GEMV (counted on the old composition), and returns bitwise what the old
    composition (ops.rms_norm, then ops.linear / linear_silu_and_mul) returns."""
    monkeypatch.setattr(ops, "use_triton", lambda t: True)  # the Triton paths, interpreted
    if mode == "KVLOOM_NO_GEMV":
        monkeypatch.setenv("KVLOOM_NO_GEMV", "1")
    if mode == "deterministic":
        monkeypatch.setattr(dispatch, "_batch_invariant", True)
    plain = Counter(monkeypatch, gt, "gemv_silu_and_mul_triton" if silu else "gemv_triton")
    fused = Counter(monkeypatch, gt, "rms_norm_gemv_triton")
    norm = Counter(monkeypatch, rt, "rms_norm_triton")
    x, res, norm_w, w, b = make_inputs(rows, 2 * 20, 96, dtype, seed=rows, bias=True, row_pad=0)
    x, res = x.reshape(rows, 1, 96), res.reshape(rows, 1, 96)  # [T, 1, K]: rows flattened

    normed, new_res = ops.rms_norm(x, norm_w, EPS, res)
    project = ops.linear_silu_and_mul if silu else ops.linear
    expected = project(normed, w, b)
    took_gemv = plain.calls
    assert took_gemv == (mode == "default" and dtype == torch.bfloat16 and rows <= 2)

    plain.calls = norm.calls = 0
    y, got_res, got_normed = ops.rms_norm_linear(
        x, res, norm_w, EPS, w, b, silu_and_mul=silu, write_normed=True
    )
    assert fused.calls == took_gemv
    assert plain.calls == 0 and norm.calls == 1 - took_gemv  # both launches gone when fused
    assert torch.equal(y, expected) and y.shape == expected.shape
    assert torch.equal(got_res, new_res) and got_res.shape == x.shape
    assert torch.equal(got_normed, normed) and got_normed.shape == x.shape
    _, _, none = ops.rms_norm_linear(x, res, norm_w, EPS, w, b, silu_and_mul=silu)
    assert none is None


def test_ops_keep_two_calls_for_a_float32_norm_weight(monkeypatch):
    """A norm weight of another dtype than x (its output would be float32): two calls."""
    monkeypatch.setattr(ops, "use_triton", lambda t: True)
    fused = Counter(monkeypatch, gt, "rms_norm_gemv_triton")
    x, res, norm_w, w, _ = make_inputs(1, 16, 64, torch.bfloat16, seed=5, row_pad=0)
    ops.rms_norm_linear(x, res, norm_w.float(), EPS, w.float())
    assert fused.calls == 0


# ---------------------------------------------------------------- the benchmark


@pytest.mark.skipif(CUDA, reason="the real run is the GPU benchmark itself")
def test_benchmark_tiny_run_writes_json(tmp_path):
    from benchmarks import norm_gemv_fusion

    out = tmp_path / "fusion.json"
    result = norm_gemv_fusion.main(["--tiny", "--out", str(out)])
    assert out.exists() and result["timing"] == "cpu_interpreter_wall"
    impls = [r["impl"] for r in result["rows"]]
    runs = len(norm_gemv_fusion.TINY_SHAPES) * len(norm_gemv_fusion.BATCHES)
    assert impls.count("norm+gemv") == impls.count("fused") == runs
    fused = [r for r in result["rows"] if r["impl"].startswith("fused")]
    assert len(fused) > runs  # wider-tile variants too
    assert all(r["same_bits_as_two_launches"] and r["speedup_vs_two_launches"] > 0 for r in fused)
    # The GDN in_proj's conv epilogue (shapes with conv channels): fused vs two launches.
    conv_runs = sum(1 for s in norm_gemv_fusion.TINY_SHAPES if s[-1]) * len(
        norm_gemv_fusion.BATCHES
    )
    conv = [r for r in result["rows"] if r["impl"] == "conv:fused"]
    assert conv_runs >= 1 and len(conv) == impls.count("conv:two_launches") == conv_runs
    assert all(r["same_bits_as_two_launches"] for r in conv)


# ---------------------------------------------------------------- GPU: real shapes


@gpu
@needs_cuda
@pytest.mark.parametrize(
    ("k", "n", "silu", "offset"),
    [
        (4096, 6144, False, 0.0),  # Qwen3-8B qkv_proj
        (4096, 24576, True, 0.0),  # Qwen3-8B gate_up
        (2048, 12352, False, 1.0),  # Qwen3-Next fused GDN in_proj
        (2048, 9216, False, 1.0),  # Qwen3-Next attention qkv (+ gate)
        (2048, 512, False, 1.0),  # Qwen3-Next router (512 experts)
        (5120, 10240, False, 0.0),  # a 5120-wide model: 5 sum steps, default plan
    ],
)
def test_gpu_real_shapes_bitwise(k, n, silu, offset):
    """Compiled, bf16: bitwise the two launches at 1 and 2 rows with the chosen plan, and
    with a split-K plan; normed rows stored."""
    for rows in (1, 2):
        case = make_inputs(rows, n, k, torch.bfloat16, seed=k + n + rows, offset=offset)
        check_fused(f"gpu k={k} n={n} rows={rows}", *case, offset=offset, silu=silu)
    split = GemvPlan(16, 256, 4, 3, split_k=4)
    case = make_inputs(2, n, k, torch.bfloat16, seed=k + n, offset=offset)
    check_fused(f"gpu k={k} n={n} split", *case, offset=offset, silu=silu, plan=split)


@gpu
@needs_cuda
@pytest.mark.parametrize("k", [4096, 5120])
def test_gpu_float32_statistic_bitwise(k):
    """float32 rows keep the statistic's last bits: compiled with the GEMV plan's warps
    (not the norm kernel's), the fused 1 / rms must still be the norm kernel's."""
    case = make_inputs(2, 1024, k, torch.float32, seed=k)
    check_fused(f"gpu float32 k={k}", *case)


@gpu
@needs_cuda
def test_gpu_cuda_graph_capture():
    """Captured once (allocating only its outputs), replayed on new inputs: equal to the
    eager two launches bit for bit."""
    k, n = 4096, 6144
    x, res, norm_w, w, _ = make_inputs(1, n, k, torch.bfloat16, seed=91, row_pad=0)
    static_x, static_res = x.clone(), res.clone()
    rms_norm_gemv_triton(static_x, static_res, norm_w, EPS, w)  # compile outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = rms_norm_gemv_triton(static_x, static_res, norm_w, EPS, w, write_normed=True)
    for seed in (92, 93):
        fresh_x, fresh_res, *_ = make_inputs(1, n, k, torch.bfloat16, seed=seed, row_pad=0)
        static_x.copy_(fresh_x)
        static_res.copy_(fresh_res)
        graph.replay()
        torch.cuda.synchronize()
        want = two_launches(fresh_x, fresh_res, norm_w, w, None, offset=0.0, silu=False, plan=None)
        for got, expected in zip(outs, want):
            assert torch.equal(got, expected)


# ---------------------------------------------------------------- a model's decode


def _force_decode_kernels(monkeypatch, fuse: bool):
    """On the CPU: the linear layers take the GEMV at decode sizes and every RMSNorm the
    Triton kernel, interpreted (attention and the rest keep their references), as on a
    GPU; `fuse` False turns the fused launch off (the composition before it). With CUDA
    the test is skipped: it builds its models on the CPU (on an H200 the LLM's weights
    and these CPU-made inputs met on two devices); the gpu-marked tests cover the GPU."""
    if CUDA:
        pytest.skip("a CPU-interpreter check of a model's decode; gpu tests cover the GPU")
    from kvloom.workers.layers import norm as norm_module

    def takes_gemv(x, w):
        rows = x.numel() // max(x.shape[-1], 1)
        half = x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
        return half and w.is_contiguous() and x.stride(-1) == 1 and 1 <= rows <= 2

    def triton_norm(x, weight, eps, residual=None, weight_offset=0.0):
        return rt.rms_norm_triton(x, weight, eps, residual, weight_offset)

    # Wide tiles: the interpreter's cost is per program, and the tiling never changes
    # results (GemvPlan); the kernels' own tests cover the narrow plans.
    monkeypatch.setattr(gt, "default_gemv_plan", lambda n, k: gt.GemvPlan(64, 128, 4, 1))
    monkeypatch.setattr(ops, "_takes_gemv", takes_gemv)
    monkeypatch.setattr(ops, "rms_norm", triton_norm)
    monkeypatch.setattr(norm_module, "rms_norm", triton_norm)
    if not fuse:
        monkeypatch.setattr(ops, "_takes_norm_gemv", lambda *args: False)


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_decode_is_bitwise_the_same_fused(monkeypatch, tiny_model, hybrid_model, arch):
    """A tiny bf16 model's greedy decode through the fused norm + projection launches
    equals the two-launch composition bit for bit: the tokens, their logprobs, and the
    last layer's hidden state and residual at every step (read at the final norm, before
    the bf16 logits' coarse rounding could hide a difference). The fused launch runs for
    both norms of every layer at each decode step (one row), never at the prefill.
    Qwen3-Next: zero-centred norms (weight_offset 1) before the GDN's fused in_proj, the
    attention's qkv_proj and the MoE router (its normed rows stored for the experts).
    Eager (no CUDA graphs on a GPU), so the hooks see every step."""
    from kvloom import LLM
    from kvloom.contracts.sampling_params import SamplingParams
    from kvloom.workers.layers.norm import RMSNorm

    path = tiny_model("llama") if arch == "llama" else hybrid_model(arch)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=5)
    prompt = [5, 17, 33, 9, 61, 7]
    results = {}
    for fuse in (False, True):
        with monkeypatch.context() as patch:
            _force_decode_kernels(patch, fuse)
            # The MoE router's norm + GEMV here, not its router_gemv launch (counted in
            # tests/test_gemv_route.py).
            patch.setenv("KVLOOM_UNFUSED", "router_gemv")
            # Qwen3-Next's GDN in_proj at decode: the norm + GEMV with the conv update in
            # its epilogue (tests/test_gdn_conv_epilogue.py), or the GEMV with it.
            fused_kinds = [Counter(patch, gt, "rms_norm_gemv_triton")]
            fused_kinds.append(Counter(patch, gt, "rms_norm_gemv_conv_triton"))
            launches = [*fused_kinds, Counter(patch, rt, "rms_norm_triton")]
            gemvs = ("gemv_triton", GATED, "gemv_conv_triton")
            launches += [Counter(patch, gt, name) for name in gemvs]
            llm = LLM(
                str(path), dtype="bfloat16", progress=False, block_size=16, enforce_eager=True
            )
            model = llm.engine.executor.worker.runner.model
            for seed, module in enumerate(model.modules()):  # the checkpoint's are all 1
                if isinstance(module, RMSNorm) and module.weight.dim() == 1:
                    weight = module.weight
                    weight.copy_(randn(*weight.shape, seed=seed, dtype=weight.dtype, scale=0.3))
                    weight += 1 - module.weight_offset
            states, rows = record_steps(model)
            out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
            small_steps = sum(1 for n in rows if n <= NORM_GEMV_MAX_M)
            total = sum(c.calls for c in launches)
            layers = len(model.model.layers)
            fused_calls = sum(c.calls for c in fused_kinds)
            results[fuse] = (out, states, fused_calls, total, layers, small_steps)
    plain, plain_states, plain_calls, plain_total, _, _ = results[False]
    got, got_states, fused_calls, fused_total, layers, small_steps = results[True]
    # Every step of at most NORM_GEMV_MAX_M rows (the decodes, and a short prefill chunk
    # if the scheduler cut one) fuses both norms of every layer: each fused launch
    # replaces a norm launch and a GEMV launch.
    assert small_steps >= params.max_tokens - 1
    assert plain_calls == 0 and fused_calls == 2 * layers * small_steps
    assert plain_total - fused_total == 2 * layers * small_steps
    assert len(plain_states) == len(got_states) >= params.max_tokens
    for step, (want, have) in enumerate(zip(plain_states, got_states)):
        assert all(torch.equal(a, b) for a, b in zip(want, have, strict=True)), step
    assert got.token_ids == plain.token_ids
    assert len(plain.logprobs) == params.max_tokens and got.logprobs == plain.logprobs
