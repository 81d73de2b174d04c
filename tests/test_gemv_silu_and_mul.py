"""The gate_up GEMV with SiLU-and-mul fused into its store (`gemv_silu_and_mul_triton`):
bitwise equal to the plain GEMV followed by the activation kernel (same plan), near the
torch reference, and taken by the gated MLP exactly where the plain GEMV would run.

Without CUDA the kernels run in Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1; the interpreter rounds bfloat16 as the GPU does, tests/triton_interpret
/conftest.py) at small shapes; with CUDA the same tests run compiled, and the `gpu`-marked
ones add Qwen3-8B's gate_up shape and CUDA-graph capture. torch.empty is NaN-filled while
a test runs (test_gemv's autouse fixture), so an output element left unwritten shows.

Tolerance against the reference (`gemv_silu_and_mul_ref`): gate and up are each a sum the
kernel and the reference order differently, so each may land an ulp apart (plus the two
sums' float32 error, as test_gemv bounds it); that moves silu(gate) by at most
max|silu'| < 1.1 times as much, and both sides round silu and the product once (the
kernel's exp may differ from torch's in the last float32 bits: 4 ulps of silu allowed).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks import gemv_silu_fusion
from kvloom.kernels import activation_triton as at
from kvloom.kernels import dispatch, ops
from kvloom.kernels import gemv_triton as gt
from kvloom.kernels.activation_triton import silu_and_mul_triton
from kvloom.kernels.gemv import GEMV_DISPATCH_MAX_M, gemv_ref, gemv_silu_and_mul_ref
from kvloom.kernels.gemv_triton import GemvPlan, gemv_silu_and_mul_triton, gemv_triton
from kvloom.workers.layers.mlp import GatedMLP
from tests.kernel_env import CUDA, DEVICE, gpu, needs_cuda
from tests.test_gemv import make_case, nan_filled_empty, randn, ulp  # noqa: F401 (autouse)

# The gate_up plan's tiling, halved per half: block_n 1 (bumped to one gate + one up row),
# 2, 8, 16 (4 .. 8 features per program, none dividing I = 37), one to three 64-lane
# chunks per step; split_k 2 and 3 (the activation then runs in the reduce launch).
PLANS = (
    None,
    GemvPlan(1, 64, 1, 1),
    GemvPlan(2, 128, 1, 2),
    GemvPlan(8, 128, 2, 2),
    GemvPlan(16, 192, 4, 3),
    GemvPlan(8, 128, 2, 2, split_k=2),
    GemvPlan(4, 64, 2, 3, split_k=3),
)


def two_launches(x, w, b=None, plan=None):
    """What the MLP ran before: the plain GEMV, then the activation kernel."""
    return silu_and_mul_triton(gemv_triton(x, w, b, plan=plan))


def sum_error(x, w, b):
    """Bound on a float32 sum's error, as test_gemv's check_gemv (both orders)."""
    k = x.shape[1]
    scale = x.double().cpu().abs() @ w.double().cpu().abs().t()
    if b is not None:
        scale = scale + b.double().cpu().abs()
    return (4 * (k / 64 + 6) + k) * 2.0**-24 * scale


def check_near_reference(name, y, x, w, b):
    """y against gemv_silu_and_mul_ref within the module docstring's bound."""
    i = w.shape[0] // 2
    assert y.dtype == x.dtype and tuple(y.shape) == (x.shape[0], i)
    assert not torch.isnan(y).any(), f"{name}: NaN in the output (an element left unwritten)"
    dtype = x.dtype
    gate_up = gemv_ref(x, w, b).double().cpu()
    gate, up = gate_up[:, :i], gate_up[:, i:]
    silu = F.silu(gate)
    ref = gemv_silu_and_mul_ref(x, w, b).double().cpu()
    err_sum = sum_error(x, w, b)
    d_gate = ulp(gate, dtype) + err_sum[:, :i]
    d_up = ulp(up, dtype) + err_sum[:, i:]
    d_silu = 1.1 * d_gate + 4 * ulp(silu, dtype)
    bound = up.abs() * d_silu + (silu.abs() + d_silu) * d_up + 2 * ulp(ref, dtype)
    err = (y.double().cpu() - ref).abs()
    print(f"ERRNORM {name}: max_abs_vs_ref={err.max().item():.3e} "
          f"worst_bound_ratio={(err / bound).max().item():.3f}")  # fmt: skip
    assert (err <= bound).all(), f"{name}: error {(err / bound).max().item():.2f}x the bound"


# ---------------------------------------------------------------- the kernel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 2])
def test_fused_equals_two_launches_bitwise(dtype, rows):
    """I = 37 (no block's multiple), K = 200 (below / not a multiple of block_k), strided
    rows; a bias on every other plan; every plan bitwise equal to the two launches."""
    cases = {bias: make_case(rows, 2 * 37, 200, dtype, seed=rows, bias=bias, row_pad=3)
             for bias in (False, True)}  # fmt: skip
    for index, plan in enumerate(PLANS):
        x, w, b = cases[index % 2 == 1]
        fused = gemv_silu_and_mul_triton(x, w, b, plan=plan)
        name = f"{dtype} rows={rows} bias={b is not None} {plan.name if plan else 'chosen'}"
        check_near_reference(name, fused, x, w, b)
        assert torch.equal(fused, two_launches(x, w, b, plan)), name


def test_plans_of_one_split_agree_bitwise():
    """As the plain GEMV (invariant 7): the tiling changes speed, not bits."""
    x, w, b = make_case(2, 2 * 45, 330, torch.bfloat16, seed=30, row_pad=5)
    outs = {p: gemv_silu_and_mul_triton(x, w, b, plan=p) for p in PLANS[1:]}
    for split in (1, 2):
        group = [p for p in PLANS[1:] if p.split_k == split]
        for plan in group[1:]:
            assert torch.equal(outs[plan], outs[group[0]]), f"{plan.name} vs {group[0].name}"


def test_rows_are_independent_bitwise():
    x, w, b = make_case(gt.GEMV_MAX_M, 2 * 21, 130, torch.bfloat16, seed=40)
    full = gemv_silu_and_mul_triton(x, w, b)
    check_near_reference("8 rows", full, x, w, b)
    assert torch.equal(full, two_launches(x, w, b))
    for t in (0, 3, 7):
        assert torch.equal(gemv_silu_and_mul_triton(x[t : t + 1], w, b)[0], full[t]), t


def test_edge_shapes():
    x, w, b = make_case(2, 2, 70, torch.float32, seed=50)  # I = 1
    assert torch.equal(gemv_silu_and_mul_triton(x, w, b), two_launches(x, w, b))
    x, w, b = make_case(2, 6, 0, torch.bfloat16, seed=51)  # K = 0: silu(b_gate) * b_up
    fused = gemv_silu_and_mul_triton(x, w, b)
    check_near_reference("K = 0", fused, x, w, b)
    assert torch.equal(fused, two_launches(x, w, b))
    x, w, _ = make_case(0, 6, 5, torch.bfloat16, seed=52)
    assert gemv_silu_and_mul_triton(x, w).shape == (0, 3)


def test_bad_input_names_the_field():
    x, w, b = make_case(2, 8, 16, torch.float32, seed=80)
    with pytest.raises(ValueError, match="weight: expected \\[gate; up\\]"):
        gemv_silu_and_mul_triton(x, w[:7])
    with pytest.raises(ValueError, match="weight: expected \\[gate; up\\]"):
        gemv_silu_and_mul_ref(x, w[:7])
    with pytest.raises(ValueError, match="x: 9 rows"):
        gemv_silu_and_mul_triton(torch.ones(9, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="bias"):
        gemv_silu_and_mul_triton(x, w, b[:7])
    with pytest.raises(ValueError, match="plan"):
        gemv_silu_and_mul_triton(x, w, plan=(8, 64, 2, 1))


# ---------------------------------------------------------------- the MLP's dispatch


class Counter:
    """Wraps a module function and counts its calls."""

    def __init__(self, monkeypatch, module, name):
        self.calls = 0
        real = getattr(module, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


def _mlp(dtype, bias, hidden=96, inter=40):
    mlp = GatedMLP(hidden, inter, bias=bias, dtype=dtype).to(DEVICE)
    for seed, p in enumerate(mlp.parameters()):
        p.data.copy_(randn(*p.shape, seed=300 + seed, dtype=dtype, scale=p.shape[-1] ** -0.5))
    return mlp


@pytest.mark.parametrize("mode", ["default", "KVLOOM_NO_GEMV", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, GEMV_DISPATCH_MAX_M, GEMV_DISPATCH_MAX_M + 1])
def test_mlp_fuses_exactly_where_the_plain_gemv_runs(monkeypatch, mode, dtype, rows):
    """The fused launch replaces the gate_up GEMV + activation launches exactly when the
    gate_up projection alone would take the GEMV (counted on the old composition), and
    the MLP's output is bitwise that of the old composition either way."""
    monkeypatch.setattr(ops, "use_triton", lambda t: True)  # the Triton paths, interpreted
    if mode == "KVLOOM_NO_GEMV":
        monkeypatch.setenv("KVLOOM_NO_GEMV", "1")
    if mode == "deterministic":
        monkeypatch.setattr(dispatch, "_batch_invariant", True)
    gemv = Counter(monkeypatch, gt, "gemv_triton")
    fused = Counter(monkeypatch, gt, "gemv_silu_and_mul_triton")
    act = Counter(monkeypatch, at, "silu_and_mul_triton")
    mlp = _mlp(dtype, bias=rows == GEMV_DISPATCH_MAX_M)
    x = randn(rows, 96, seed=rows, dtype=dtype)

    gate_up = mlp.gate_up_proj(x)
    plain_took_gemv = gemv.calls
    assert plain_took_gemv == (mode == "default" and dtype == torch.bfloat16 and rows <= 2)
    expected = mlp.down_proj(ops.silu_and_mul(gate_up))

    gemv.calls = act.calls = 0
    out = mlp(x)
    assert fused.calls == plain_took_gemv
    assert act.calls == 1 - plain_took_gemv  # the activation launch is gone when fused
    assert gemv.calls == plain_took_gemv  # the down projection's GEMV only
    assert torch.equal(out, expected)


def test_mlp_keeps_the_quantized_gate_up_path(monkeypatch):
    """A quantized gate_up projection runs its own method, then the activation."""
    monkeypatch.setattr(ops, "use_triton", lambda t: True)
    fused = Counter(monkeypatch, gt, "gemv_silu_and_mul_triton")
    mlp = _mlp(torch.bfloat16, bias=False)
    applied = []

    class FakeQuant:
        def apply(self, layer, x, bias):
            applied.append(layer)
            return F.linear(x, layer.weight, bias)

    mlp.gate_up_proj.quant_method = FakeQuant()
    x = randn(1, 96, seed=5, dtype=torch.bfloat16)
    out = mlp(x)
    assert applied == [mlp.gate_up_proj] and fused.calls == 0
    gate_up = F.linear(x, mlp.gate_up_proj.weight)
    assert torch.equal(out, mlp.down_proj(silu_and_mul_triton(gate_up)))


# ---------------------------------------------------------------- the benchmark


@pytest.mark.skipif(CUDA, reason="the real run is the GPU benchmark itself")
def test_benchmark_tiny_run_writes_json(tmp_path):
    out = tmp_path / "fusion.json"
    result = gemv_silu_fusion.main(["--tiny", "--out", str(out)])
    assert out.exists() and result["timing"] == "cpu_interpreter_wall"
    impls = [r["impl"] for r in result["rows"]]
    assert impls == ["cublas+silu", "gemv+silu", "fused"] * len(gemv_silu_fusion.BATCHES)
    fused = [r for r in result["rows"] if r["impl"] == "fused"]
    assert all(r["same_bits_as_two_launches"] and r["speedup_vs_two_launches"] > 0 for r in fused)


# ---------------------------------------------------------------- GPU: real shapes


@gpu
@needs_cuda
@pytest.mark.parametrize(("k", "i"), [(4096, 12288), (2048, 768)])
def test_gpu_real_shapes_bitwise(k, i):
    """Qwen3-8B's gate_up (K = 4096, I = 12288) and a small shared expert's (I = 768),
    bf16, compiled: bitwise the two launches at 1 and 2 rows, with the chosen plan, a
    bias, and a split-K plan."""
    x, w, b = make_case(2, 2 * i, k, torch.bfloat16, seed=k + i)
    for rows in (1, 2):
        fused = gemv_silu_and_mul_triton(x[:rows], w)
        check_near_reference(f"gpu k={k} i={i} rows={rows}", fused, x[:rows], w, None)
        assert torch.equal(fused, two_launches(x[:rows], w)), rows
    assert torch.equal(gemv_silu_and_mul_triton(x, w, b), two_launches(x, w, b))
    split = GemvPlan(16, 256, 4, 3, split_k=4)
    assert torch.equal(gemv_silu_and_mul_triton(x, w, plan=split), two_launches(x, w, plan=split))


@gpu
@needs_cuda
def test_gpu_cuda_graph_capture():
    """Captured once (allocating only its output), replayed on new inputs: equal to the
    eager two launches bit for bit."""
    k, i = 4096, 12288
    x, w, _ = make_case(1, 2 * i, k, torch.bfloat16, seed=91)
    static_x = x.clone()
    gemv_silu_and_mul_triton(static_x, w)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = gemv_silu_and_mul_triton(static_x, w)
    for seed in (92, 93):
        fresh = randn(1, k, seed=seed, dtype=torch.bfloat16)
        static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, two_launches(fresh, w))
