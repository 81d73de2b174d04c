"""The small-M GEMV (`gemv_triton`) against its torch reference (`gemv_ref`), its
summation-order promises, its argument checks, and the plan benchmark's pure helpers.

Without CUDA the kernel runs in Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1) at small shapes; with CUDA the same tests run compiled, and the
`gpu`-marked ones add the Qwen3-8B decode shapes and CUDA-graph capture. Inputs are fresh
normal values; `torch.empty` is NaN-filled while a kernel runs, so an output or split-K
workspace element the kernel forgets to write shows up as NaN.

Tolerance, per element, against the float64 product (|x| |w| summed is `scale`):
    |y - exact| <= ulp(y) / 2 + 4 (K / 64 + 6) 2^-24 scale
One rounding to the output dtype, plus the float32 error of a 64-lane sum: each lane adds
about K / 64 terms in sequence, then a 6-level tree adds the lanes (factor 4: slack for
the rounding of the products and of the bias add). The interpreter narrows float32 to
bfloat16 by truncation where the GPU rounds to nearest even; the tests/triton_interpret
helper makes it round, so the half-ulp term holds in both.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from benchmarks import gemv_plans
from kvloom.kernels import gemv_triton as gt
from kvloom.kernels.gemv import GEMV_DISPATCH_MAX_M, gemv_ref
from kvloom.kernels.gemv_triton import (
    GEMV_MAX_M,
    GemvPlan,
    check_plan_table,
    choose_gemv_plan,
    default_gemv_plan,
    gemv_triton,
    hopper_block_n,
)
from kvloom.kernels.quant_gemv_triton import default_quant_gemv_plan
from tests.kernel_env import CUDA, DEVICE, gpu, needs_cuda

MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}

# Plan variants at small shapes: block_n 1..32, one to three 64-lane chunks per step, one
# to four pipeline stages, warps that do and do not match the tile, split_k 1, 2 and 3.
PLAN_VARIANTS = (
    GemvPlan(8, 64, 2, 1),
    GemvPlan(16, 128, 4, 3),
    GemvPlan(4, 192, 1, 2),
    GemvPlan(32, 64, 8, 4),
    GemvPlan(1, 128, 1, 1),
    GemvPlan(8, 128, 2, 2, split_k=2),
    GemvPlan(16, 64, 4, 1, split_k=2),
    GemvPlan(4, 64, 2, 3, split_k=3),
    GemvPlan(16, 192, 4, 2, split_k=3),
)


@pytest.fixture(autouse=True)
def nan_filled_empty(monkeypatch):
    """Uninitialised float memory reads as NaN while a test runs."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


def randn(*shape, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    """Fresh normal values made on the CPU (same on every device), moved to DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


def make_case(m, n, k, dtype, seed, bias=True, row_pad=0):
    """x [m, k] (rows strided by k + row_pad when row_pad > 0), weight [n, k] scaled so
    outputs are O(1), bias [n] or None."""
    x = randn(m, k + row_pad, seed=seed, dtype=dtype)[:, :k]
    w = randn(n, k, seed=seed + 1, dtype=dtype, scale=max(k, 1) ** -0.5)
    b = randn(n, seed=seed + 2, dtype=dtype) if bias else None
    return x, w, b


def ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Unit in the last place of `dtype` at |t| (float64)."""
    _, exp = torch.frexp(t.abs().clamp_min(torch.finfo(dtype).tiny))
    return torch.ldexp(torch.ones_like(t), exp - 1 - MANTISSA_BITS[dtype])


def check_gemv(name, y, x, w, b):
    """y against the float64 product (bound in the module docstring) and gemv_ref."""
    m, k = x.shape
    assert y.dtype == x.dtype and tuple(y.shape) == (m, w.shape[0])
    assert not torch.isnan(y).any(), f"{name}: NaN in the output (an element left unwritten)"
    x64, w64 = x.double().cpu(), w.double().cpu()
    exact = x64 @ w64.t()
    scale = x64.abs() @ w64.abs().t()
    if b is not None:
        exact = exact + b.double().cpu()
        scale = scale + b.double().cpu().abs()
    y64 = y.double().cpu()
    sum_bound = 4 * (k / 64 + 6) * 2.0**-24 * scale
    bound = ulp(torch.maximum(y64.abs(), exact.abs()), x.dtype) / 2 + sum_bound
    err = (y64 - exact).abs()
    ref = gemv_ref(x, w, b).double().cpu()
    diff_ref = (y64 - ref).abs()
    print(
        f"ERRNORM {name}: max_abs_vs_exact={err.max().item() if err.numel() else 0:.3e} "
        f"worst_bound_ratio={(err / bound).max().item() if err.numel() else 0:.3f} "
        f"max_abs_vs_ref={diff_ref.max().item() if diff_ref.numel() else 0:.3e} "
        f"elements_differing_from_ref={int((diff_ref > 0).sum())}/{diff_ref.numel()}"
    )
    assert (err <= bound).all(), f"{name}: error {(err / bound).max().item():.2f}x the bound"
    # Both round a float32 sum of the same terms once: an ulp apart at most, plus the two
    # sums' float32 errors (the reference's matmul: at worst K sequential additions).
    ref_bound = ulp(torch.maximum(y64.abs(), ref.abs()), x.dtype) + sum_bound
    assert (diff_ref <= ref_bound + k * 2.0**-24 * scale).all(), f"{name}: far from gemv_ref"


# ---------------------------------------------------------------- the reference


def test_reference_matches_float64_linear():
    x, w, b = make_case(3, 7, 11, torch.float64, seed=1)
    torch.testing.assert_close(gemv_ref(x, w, b), F.linear(x, w, b), rtol=1e-12, atol=1e-12)


def test_reference_adds_bias_before_its_one_rounding():
    x, w, b = make_case(4, 64, 96, torch.bfloat16, seed=2)
    y = gemv_ref(x, w, b)
    once = (x.float() @ w.float().t() + b.float()).to(torch.bfloat16)
    twice = (x.float() @ w.float().t()).to(torch.bfloat16) + b
    assert torch.equal(y, once)
    assert not torch.equal(y, twice)  # the case is one where the two roundings differ


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "b_shape", "field"),
    [((2, 3, 4), (5, 4), None, "x"), ((2, 4), (5, 3), None, "weight"), ((2, 4), (5, 4), (4,), "bias")],
)  # fmt: skip
def test_reference_rejects_bad_shapes(x_shape, w_shape, b_shape, field):
    b = torch.zeros(b_shape) if b_shape else None
    with pytest.raises(ValueError, match=field):
        gemv_ref(torch.ones(x_shape), torch.ones(w_shape), b)


# ---------------------------------------------------------------- the kernel


@pytest.mark.parametrize("m", range(1, GEMV_MAX_M + 1))
def test_every_row_count_matches_reference(m):
    # N and K not multiples of any block; K < the default block_k (512); strided rows.
    x, w, b = make_case(m, 37, 200, torch.bfloat16, seed=10 + m, bias=m % 2 == 1, row_pad=9)
    check_gemv(f"bf16 m={m}", gemv_triton(x, w, b), x, w, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_k", [1, 2])
def test_dtypes(dtype, split_k):
    x, w, b = make_case(3, 29, 300, dtype, seed=20, row_pad=3)
    y = gemv_triton(x, w, b, plan=GemvPlan(8, 128, 2, 2, split_k))
    check_gemv(f"{dtype} split_k={split_k}", y, x, w, b)


def test_plan_variants_match_reference_and_each_other_bitwise():
    """Invariant 7: plans change speed, not bits, for one split_k."""
    x, w, b = make_case(5, 45, 330, torch.bfloat16, seed=30, row_pad=5)
    outs = {}
    for plan in PLAN_VARIANTS:
        outs[plan] = gemv_triton(x, w, b, plan=plan)
        check_gemv(plan.name, outs[plan], x, w, b)
    for split in {p.split_k for p in PLAN_VARIANTS}:
        group = [p for p in PLAN_VARIANTS if p.split_k == split]
        assert len(group) >= 2
        for plan in group[1:]:
            assert torch.equal(outs[plan], outs[group[0]]), f"{plan.name} vs {group[0].name}"


@pytest.mark.parametrize("plan", [GemvPlan(8, 128, 2, 2), GemvPlan(16, 64, 4, 1, split_k=3)])
def test_rows_are_independent_bitwise(plan):
    """Row t of a batch-8 launch equals a batch-1 launch on row t, and row t of a batch-3
    launch of rows 2..4, bit for bit."""
    x, w, b = make_case(GEMV_MAX_M, 40, 260, torch.bfloat16, seed=40, row_pad=7)
    full = gemv_triton(x, w, b, plan=plan)
    check_gemv(f"rows {plan.name}", full, x, w, b)
    for t in range(GEMV_MAX_M):
        assert torch.equal(gemv_triton(x[t : t + 1], w, b, plan=plan)[0], full[t]), t
    assert torch.equal(gemv_triton(x[2:5], w, b, plan=plan), full[2:5])


def test_chosen_plans_keep_rows_independent(monkeypatch):
    """With a table that picks a different tiling per M (one split_k), a row's output
    still does not depend on how many rows share its launch."""
    n, k = 24, 200
    table = {
        (n, k): {
            1: GemvPlan(8, 64, 2, 1, 2),
            2: GemvPlan(16, 128, 4, 2, 2),
            4: GemvPlan(4, 192, 1, 3, 2),
            GEMV_MAX_M: GemvPlan(32, 64, 8, 2, 2),
        }
    }
    monkeypatch.setattr(gt, "GEMV_PLAN_TABLE", table)
    assert choose_gemv_plan(3, n, k, torch.bfloat16) == table[(n, k)][4]
    x, w, b = make_case(GEMV_MAX_M, n, k, torch.bfloat16, seed=45)
    full = gemv_triton(x, w, b)
    check_gemv("chosen plans", full, x, w, b)
    for rows in (slice(0, 1), slice(1, 3), slice(3, 6)):
        assert torch.equal(gemv_triton(x[rows], w, b), full[rows]), rows


@pytest.mark.parametrize(
    ("m", "n", "k", "plan"),
    [
        (2, 19, 40, GemvPlan(8, 128, 2, 2)),  # K below one 64-lane chunk
        (3, 9, 1, GemvPlan(4, 64, 1, 1)),  # K = 1
        (2, 1, 70, GemvPlan(16, 64, 4, 2, 2)),  # N = 1, second K range of 6 columns
        (4, 13, 65, GemvPlan(8, 64, 2, 1, 4)),  # more K ranges than 64-lane chunks
    ],
)
def test_edge_shapes(m, n, k, plan):
    x, w, b = make_case(m, n, k, torch.float32, seed=50 + k)
    check_gemv(f"edge m={m} n={n} k={k} {plan.name}", gemv_triton(x, w, b, plan=plan), x, w, b)


def test_empty_dims():
    x, w, b = make_case(2, 6, 0, torch.bfloat16, seed=60)
    assert torch.equal(gemv_triton(x, w, b), b.expand(2, 6))  # K = 0: the bias alone
    assert torch.equal(gemv_triton(x, w), torch.zeros(2, 6, dtype=torch.bfloat16, device=DEVICE))
    x, w, _ = make_case(0, 6, 5, torch.bfloat16, seed=61)
    assert gemv_triton(x, w).shape == (0, 6)


def test_broadcast_rows():
    """A row stride of 0 (one row expanded) is a valid strided x."""
    x, w, b = make_case(1, 21, 130, torch.float16, seed=70)
    xs = x.expand(4, -1)
    y = gemv_triton(xs, w, b, plan=GemvPlan(8, 64, 2, 2))
    check_gemv("expanded rows", y, xs, w, b)
    assert torch.equal(y[3], y[0])


# ---------------------------------------------------------------- bad input


def _bad_calls():
    x, w, b = make_case(2, 8, 16, torch.float32, seed=80)
    return [
        ("x", lambda: gemv_triton(x[0], w)),
        ("x", lambda: gemv_triton(x[None], w)),
        ("x", lambda: gemv_triton(torch.ones(9, 16, device=DEVICE), w)),  # M > GEMV_MAX_M
        ("x", lambda: gemv_triton(x.to(torch.float64), w.to(torch.float64))),
        ("x", lambda: gemv_triton(randn(16, 2, seed=1).t(), w)),  # last dim strided
        ("x", lambda: gemv_triton(x.tolist(), w)),
        ("weight", lambda: gemv_triton(x, w[:, :15])),
        ("weight", lambda: gemv_triton(x, w.half())),
        ("weight", lambda: gemv_triton(x, randn(16, 8, seed=2).t())),  # not contiguous
        ("bias", lambda: gemv_triton(x, w, b[:7])),
        ("bias", lambda: gemv_triton(x, w, b.half())),
        ("bias", lambda: gemv_triton(x, w, randn(8, 2, seed=3)[:, 0])),  # strided
        ("plan", lambda: gemv_triton(x, w, plan=(8, 64, 2, 1))),
        ("device", lambda: gemv_triton(x, w, torch.zeros(8, device="meta"))),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_input_names_the_field(index):
    field, call = _bad_calls()[index]
    with pytest.raises(ValueError, match=field):
        call()


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w, _ = make_case(1, 4, 8, torch.float32, seed=81)
    with pytest.raises(ValueError, match="x: the Triton kernel needs a CUDA tensor"):
        gemv_triton(x.cpu(), w.cpu())


@pytest.mark.parametrize(
    ("fields", "bad"),
    [
        (dict(block_n=12), "block_n"),
        (dict(block_n=512), "block_n"),
        (dict(block_k=100), "block_k"),
        (dict(block_k=32), "block_k"),
        (dict(num_warps=3), "num_warps"),
        (dict(num_stages=0), "num_stages"),
        (dict(split_k=0), "split_k"),
        (dict(block_n=8.0), "block_n"),
        (dict(split_k=True), "split_k"),
    ],
)
def test_plan_rejects_bad_fields(fields, bad):
    good = dict(block_n=8, block_k=128, num_warps=2, num_stages=2, split_k=1)
    with pytest.raises(ValueError, match=f"plan.{bad}"):
        GemvPlan(**{**good, **fields})


def test_choose_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="m:"):
        choose_gemv_plan(0, 8, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="m:"):
        choose_gemv_plan(GEMV_MAX_M + 1, 8, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        choose_gemv_plan(1, 8, 8, torch.int8)
    with pytest.raises(ValueError, match="n, k"):
        choose_gemv_plan(1, 0, 8, torch.bfloat16)


# ---------------------------------------------------------------- plans and the table


def test_table_lookup_and_its_checks(monkeypatch):
    plans = {1: GemvPlan(8, 512, 2, 3), 2: GemvPlan(16, 512, 4, 3), 8: GemvPlan(32, 256, 8, 4)}
    monkeypatch.setattr(gt, "GEMV_PLAN_TABLE", {(4096, 2048): plans})
    got = [choose_gemv_plan(m, 4096, 2048, torch.bfloat16) for m in range(1, 9)]
    assert got == [plans[1], plans[2]] + [plans[8]] * 6
    # float32 weights and unlisted shapes take the default
    assert choose_gemv_plan(1, 4096, 2048, torch.float32) == default_gemv_plan(4096, 2048)
    assert choose_gemv_plan(1, 4096, 4096, torch.bfloat16) == default_gemv_plan(4096, 4096)
    check_plan_table({(4096, 2048): plans})
    with pytest.raises(ValueError, match="split_k"):
        check_plan_table({(1, 1): {1: GemvPlan(8, 64, 2, 1, 1), 8: GemvPlan(8, 64, 2, 1, 2)}})
    with pytest.raises(ValueError, match="include 8"):
        check_plan_table({(1, 1): {1: GemvPlan(8, 64, 2, 1)}})


@pytest.mark.parametrize(("k", "n"), gemv_plans.SHAPES_KN)
def test_default_plan_fills_a_hopper(k, n):
    """>= 1.5 programs per SM on 132 SMs unless the smallest block_n is reached, 16-byte
    bf16 vectors per thread (block_n / num_warps = 4), one split_k for every M."""
    plan = default_gemv_plan(n, k)
    assert plan.block_n // plan.num_warps == 4 and plan.block_k % 64 == 0
    assert plan.block_n == 4 or -(-n // plan.block_n) * 2 >= 3 * 132
    assert {choose_gemv_plan(m, n, k, torch.bfloat16).split_k for m in range(1, 9)} == {1}


def test_default_plan_never_takes_eight_rows_on_two_warps():
    """That plan ran up to 3.3x slower than 4 rows on 1 warp (13 of 14 timed shapes): N where the
    programs-per-SM rule picks 8 rows (1,577-3,152) takes 4; other N keep the rule's. The
    int4/FP8 GEMV's default keeps the rule's 8 rows (its kernel was not timed there)."""
    for n in (1577, 2048, 2304, 3072, 3152):
        assert hopper_block_n(n) == 8
        assert default_gemv_plan(n, 4096) == GemvPlan(4, 128, 1, 6, 1)
        assert default_quant_gemv_plan(n, 4096, "int4").block_n == 8
    for n in (1024, 3153, 4096, 24576):
        plan = default_gemv_plan(n, 4096)
        assert plan.block_n == hopper_block_n(n) and plan.num_warps == max(1, plan.block_n // 4)


# ---------------------------------------------------------------- benchmark helpers


def test_benchmark_candidates():
    names = [p.name for p in gemv_plans.CANDIDATES]
    assert 20 <= len(names) <= 40 and len(set(names)) == len(names)
    assert {p.split_k for p in gemv_plans.CANDIDATES} == {1, 2, 4}
    for k, n in gemv_plans.SHAPES_KN:  # the defaults are measured too
        assert default_gemv_plan(n, k) in gemv_plans.CANDIDATES


def test_benchmark_weight_rotation_beats_l2():
    for k, n in gemv_plans.SHAPES_KN:
        nbytes = 2 * n * k
        copies = gemv_plans.weight_copies(nbytes)
        assert gemv_plans.reuse_distance_bytes(nbytes, copies) >= gemv_plans.L2_FLUSH_BYTES
        assert copies * nbytes <= 3 * gemv_plans.L2_FLUSH_BYTES + 2 * nbytes  # no waste
    assert gemv_plans.gbps(4e9, 1e6) == pytest.approx(4.0)


def test_benchmark_pick_keeps_one_split_and_formats_a_valid_table():
    a, b, c, d = (GemvPlan(8, 512, 2, 3, 1), GemvPlan(16, 512, 4, 3, 1),
                  GemvPlan(8, 512, 2, 3, 2), GemvPlan(16, 256, 4, 3, 2))  # fmt: skip
    plans = {p.name: p for p in (a, b, c, d)}
    nan = math.nan
    # split 2 wins M=1 alone, split 1 wins the sum over M.
    times = {
        1: {a.name: 10.0, b.name: 11.0, c.name: 8.0, d.name: nan},
        2: {a.name: 12.0, b.name: 11.5, c.name: 20.0, d.name: 19.0},
        8: {a.name: nan, b.name: 30.0, c.name: 35.0, d.name: 33.0},
    }
    picks = gemv_plans.pick_plans(times, plans)
    assert picks == {1: a, 2: b, 8: b}
    assert gemv_plans.pick_plans({1: {a.name: nan}}, plans) == {}
    text = gemv_plans.format_table({(6144, 4096): picks}, {(6144, 4096): {1: "10.0 us"}})
    scope = {"GemvPlan": GemvPlan}
    exec(text, scope)
    assert scope["GEMV_PLAN_TABLE"] == {(6144, 4096): picks}
    check_plan_table(scope["GEMV_PLAN_TABLE"])
    assert "# 10.0 us" in text


def test_benchmark_ulp_error():
    ref = torch.tensor([1.0, 2.0, -3.0], dtype=torch.bfloat16)
    got = torch.tensor([1.0, 2.0 + 2**-6, -3.0], dtype=torch.bfloat16)  # one ulp at 2
    assert gemv_plans.ulp_error(got, ref) == 1.0
    assert gemv_plans.ulp_error(ref, ref) == 0.0


def test_benchmark_reports_a_failing_plan_and_goes_on():
    good, bad = GemvPlan(8, 64, 2, 1), GemvPlan(16, 64, 4, 1)
    lines = []

    def timer(launch, copies):
        launch(0)
        if launch.__defaults__ and bad in launch.__defaults__:
            raise RuntimeError("out of resources")
        return 5.0

    rows = gemv_plans.bench_shape(
        64, 24, (1,), (good, bad), DEVICE, timer, math.inf, set(), lines.append
    )
    assert [r["impl"] for r in rows] == ["cublas", good.name, bad.name]
    assert rows[1]["us"] == 5.0 and "out of resources" in rows[2]["error"]
    assert any(line.startswith("ERROR") and bad.name in line for line in lines)


@pytest.mark.skipif(CUDA, reason="the real run is the GPU benchmark itself")
def test_benchmark_tiny_run_writes_json(tmp_path):
    out = tmp_path / "gemv.json"
    result = gemv_plans.main(["--tiny", "--out", str(out)])
    assert out.exists() and result["timing"] == "cpu_interpreter_wall"
    rows = [r for r in result["rows"] if r["impl"] != "cublas"]
    assert len(rows) == len(gemv_plans.TINY_SHAPES_KN) * len(gemv_plans.TINY_BATCHES) * len(
        gemv_plans.TINY_CANDIDATES
    )
    assert all(r["same_bits_as_split_peer"] and r["max_ulp_vs_ref"] <= 1.0 for r in rows)
    assert set(result["table"]) == {f"{n}x{k}" for k, n in gemv_plans.TINY_SHAPES_KN}


# ---------------------------------------------------------------- GPU: real shapes

REAL_SHAPES_KN = ((4096, 6144), (4096, 4096), (12288, 4096), (4096, 24576), (2048, 1024))


@gpu
@needs_cuda
@pytest.mark.parametrize(("k", "n"), REAL_SHAPES_KN)
def test_gpu_real_shapes(k, n):
    """bf16 decode shapes at M = 1, 2, 4, 8: bound vs float64, rows bitwise independent,
    plans bitwise equal within a split_k."""
    x, w, b = make_case(GEMV_MAX_M, n, k, torch.bfloat16, seed=k + n)
    for m in (1, 2, 4, 8):
        y = gemv_triton(x[:m], w)
        check_gemv(f"gpu k={k} n={n} m={m}", y, x[:m], w, None)
        assert torch.equal(y, gemv_triton(x, w)[:m])
    full = gemv_triton(x, w, b)
    check_gemv(f"gpu k={k} n={n} bias", full, x, w, b)
    for t in (0, 5, 7):
        assert torch.equal(gemv_triton(x[t : t + 1], w, b)[0], full[t])
    outs = {p: gemv_triton(x, w, b, plan=p) for p in gemv_plans.CANDIDATES[:6]}
    for p, out in outs.items():
        assert torch.equal(out, full), p.name  # all split_k = 1, like the default
    split = [p for p in gemv_plans.CANDIDATES if p.split_k == 2]
    first = gemv_triton(x, w, b, plan=split[0])
    check_gemv(f"gpu k={k} n={n} {split[0].name}", first, x, w, b)
    for p in split[1:]:
        assert torch.equal(gemv_triton(x, w, b, plan=p), first), p.name


@gpu
@needs_cuda
def test_gpu_agrees_with_cublas():
    x, w, b = make_case(4, 6144, 4096, torch.bfloat16, seed=90)
    y = gemv_triton(x, w, b).double()
    cublas = F.linear(x, w, b).double()
    # both round a float32 sum once: at most an ulp apart, plus cuBLAS's own sum error
    bound = ulp(cublas.abs(), torch.bfloat16) + 1e-3 * cublas.abs().max()
    print(f"ERRNORM gpu vs cuBLAS: max_abs={(y - cublas).abs().max().item():.3e}")
    assert ((y - cublas).abs() <= bound).all()


@gpu
@needs_cuda
@pytest.mark.parametrize("plan", [None, GemvPlan(16, 256, 4, 3, split_k=4)])
def test_gpu_cuda_graph_capture(plan):
    """Captured once, replayed on new inputs copied into the static buffer: the replay
    equals an eager launch bit for bit."""
    k, n = 4096, 4096
    x, w, b = make_case(2, n, k, torch.bfloat16, seed=91)
    static_x = x.clone()
    gemv_triton(static_x, w, b, plan=plan)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = gemv_triton(static_x, w, b, plan=plan)
    for seed in (92, 93):
        fresh = randn(2, k, seed=seed, dtype=torch.bfloat16)
        static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, gemv_triton(fresh, w, b, plan=plan))
        check_gemv(f"graph replay seed={seed}", static_y.clone(), fresh, w, b)


def _linear_inputs(rows: int, dtype=torch.bfloat16):
    return (
        randn(rows, 96, seed=rows, dtype=dtype),
        randn(40, 96, seed=100 + rows, dtype=dtype),
        randn(40, seed=200 + rows, dtype=dtype),
    )


@pytest.mark.parametrize("rows", [1, GEMV_DISPATCH_MAX_M, GEMV_DISPATCH_MAX_M + 1, GEMV_MAX_M])
def test_ops_linear_routes_decode_sizes_to_the_gemv(monkeypatch, rows):
    """`ops.linear` (what the linear layers call) takes the GEMV for 1..GEMV_DISPATCH_MAX_M
    rows of a half type where Triton runs, F.linear otherwise and under KVLOOM_NO_GEMV=1."""
    from kvloom.kernels import ops

    monkeypatch.setattr(ops, "use_triton", lambda t: True)
    x, w, b = _linear_inputs(rows)
    calls = []
    real = gt.gemv_triton
    monkeypatch.setattr(gt, "gemv_triton", lambda *a, **k: calls.append(a) or real(*a, **k))
    out = ops.linear(x.view(rows, 1, 96), w, b)
    assert out.shape == (rows, 1, 40)
    if rows <= GEMV_DISPATCH_MAX_M:
        assert len(calls) == 1
        assert torch.equal(out.view(rows, 40), gemv_triton(x, w, b))
    else:
        assert not calls and torch.equal(out.view(rows, 40), F.linear(x, w, b))
    monkeypatch.setenv("KVLOOM_NO_GEMV", "1")
    calls.clear()
    assert torch.equal(ops.linear(x, w, b), F.linear(x, w, b)) and not calls


def test_kimi_linear_output_projections_take_table_plans():
    """Kimi-Linear's output projections (N 2,304 from K 4,096; its dense down from 9,216)
    ran 3x below the copy rate under the old default's 8 rows and 2 warps a program: they
    take the table's measured plans, 4 rows on 1 warp at one row (the down projection's in
    4 K ranges), 32 rows from 4 rows up for the output projection, one split_k for every M."""
    assert (2304, 4096) in gt.GEMV_PLAN_TABLE and (2304, 9216) in gt.GEMV_PLAN_TABLE
    for (n, k), split_k in (((2304, 4096), 1), ((2304, 9216), 4)):
        plan = choose_gemv_plan(1, n, k, torch.bfloat16)
        assert (plan.block_n, plan.num_warps, plan.split_k) == (4, 1, split_k)
        assert {choose_gemv_plan(m, n, k, torch.bfloat16).split_k for m in range(1, 9)} == {split_k}
    assert choose_gemv_plan(4, 2304, 4096, torch.bfloat16).block_n == 32


def test_benchmark_shapes_option():
    assert gemv_plans.parse_shape("4096,2304") == (4096, 2304)
    for bad in ("4096", "a,b", "0,5"):
        with pytest.raises(SystemExit, match="--shapes"):
            gemv_plans.parse_shape(bad)
