"""The FP8 per-token-group activation quantizer (kernels/fp8_gemm_triton.py, issue 22)
against `per_token_group_quant_fp8_ref`: quantized values and scales bitwise equal in
every plan (`QuantPlan`) and both scale layouts (row-major for the Triton GEMM,
column-major for cuBLAS), at edge shapes: one token, tokens not a multiple of the tile,
K one group, many groups, a group count and a group size that are not powers of 2,
all-zero rows and groups, groups below the eps floor, values at e4m3's max and beyond,
a strided input. Groups wider than MAX_TILE_GROUP take the chunked kernel, which is also
the benchmark's baseline: it must give the same bits.

Interpreted on the CPU at small shapes; with CUDA the same tests run compiled, and the
`gpu`-marked ones add the benchmark's shapes (1-4,096 tokens x K 2,048-12,288 in
bfloat16) and a CUDA-graph replay.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvloom.kernels.fp8_quant import FP8_MAX, per_token_group_quant_fp8_ref
from tests.kernel_env import DEVICE, gpu, needs_cuda

pytestmark = pytest.mark.skipif(
    os.environ.get("KVLOOM_TRITON_CHECKS_IN_SUBPROCESS") == "1",
    reason="triton was imported for the compiler first (run this module alone)",
)

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpret.conftest import round_bfloat16_like_the_gpu, round_fp8_like_the_gpu

    round_bfloat16_like_the_gpu()
    round_fp8_like_the_gpu()

from kvloom.kernels import fp8_gemm_triton  # noqa: E402 (after the interpreter set-up)
from kvloom.kernels.fp8_gemm_triton import (  # noqa: E402
    MAX_TILE_GROUP,
    MIN_QUANT_PROGRAMS,
    MIN_QUANT_TILE,
    QUANT_TILE,
    QuantPlan,
    choose_quant_plan,
    per_token_group_quant_fp8_triton,
)

# Plans beside the chosen one: single elements of work up to wide tiles, and tiles
# larger than the input (masked tokens and groups).
PLANS = (QuantPlan(1, 1, 4), QuantPlan(4, 2, 4), QuantPlan(2, 8, 8), QuantPlan(16, 4, 4))
# (tokens, K, group): one token and one group; tokens past a tile; many groups; 3 and
# 5 groups (not powers of 2); group sizes 96 and 384 (not powers of 2, padded lanes);
# groups of 16, 8 and 2 (many groups per tile, the chooser's MAX_BLOCK caps).
SHAPES = [(1, 128, 128), (1, 1024, 128), (9, 512, 128), (5, 96, 32), (37, 640, 128),
          (6, 288, 96), (3, 384, 384), (17, 256, 16), (70, 8, 8), (2, 64, 2)]  # fmt: skip


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def stress_input(tokens: int, width: int, group: int, dtype: torch.dtype, seed: int):
    """Random rows with the edge cases planted: an all-zero row (the last), an all-zero
    group, a group below the eps floor, a group whose max is e4m3's max, one far above
    it, and one whose elements all equal its max (each divides to 448 exactly or just
    past it: the clamp). Finite in every dtype (non-finite inputs are not covered)."""
    x = torch.randn(tokens, width, generator=gen(seed)) * 5
    x[0, :group] = 0.0
    if tokens > 1:
        x[-1] = 0.0
    if width >= 2 * group:
        x[0, group : 2 * group] *= 1e-13  # max |x| below 1e-10: the eps floor
    if width >= 3 * group:
        x[0, 2 * group] = FP8_MAX
        x[0, 2 * group + 1] = -FP8_MAX
    if tokens > 2:
        x[1, :group] *= 1e3
        x[1, -group:] = -3.0e3
    return x.to(dtype)


def nan_outputs(tokens: int, width: int, group: int, column_major: bool):
    """Output buffers filled with NaN (e4m3 0x7F), so an element a kernel leaves unwritten
    fails the bitwise check."""
    x_q = torch.full((tokens, width), 0x7F, dtype=torch.uint8, device=DEVICE)
    shape = (width // group, tokens) if column_major else (tokens, width // group)
    x_s = torch.full(shape, float("nan"), device=DEVICE)
    return x_q.view(torch.float8_e4m3fn), x_s.t() if column_major else x_s


def assert_bitwise(got, ref, label):
    got_q, got_s = got
    ref_q, ref_s = ref
    assert got_q.shape == ref_q.shape and got_s.shape == ref_s.shape, label
    same_q = got_q.cpu().view(torch.uint8) == ref_q.view(torch.uint8)
    assert same_q.all(), f"{label}: {int((~same_q).sum())} quantized values differ"
    same_s = got_s.cpu() == ref_s
    assert same_s.all(), f"{label}: {int((~same_s).sum())} scales differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("tokens", "width", "group"), SHAPES)
def test_every_plan_and_layout_is_bitwise_the_reference(dtype, tokens, width, group):
    x = stress_input(tokens, width, group, dtype, seed=tokens * width)
    ref = per_token_group_quant_fp8_ref(x, group)
    on = x.to(DEVICE)
    for column_major in (False, True):
        label = f"{tokens}x{width}/g{group} {dtype} col={column_major}"
        got = per_token_group_quant_fp8_triton(on, group, column_major)
        assert_bitwise(got, ref, label)
        assert got[1].stride() == ((1, tokens) if column_major else (width // group, 1)), label
        # Each plan into NaN-filled buffers: an element a plan leaves unwritten fails.
        chosen = choose_quant_plan(tokens, group, width // group, column_major)
        for plan in (chosen, *PLANS):
            out = nan_outputs(tokens, width, group, column_major)
            fp8_gemm_triton._launch_quant_tiles(on, *out, group, plan)
            assert_bitwise(out, ref, f"{label} plan={plan.name}")


def test_strided_rows_read_only_their_columns():
    """x a column slice of a wider tensor (row stride > K): the columns beyond it, huge,
    must not leak into any group's max."""
    wide = torch.randn(7, 640, generator=gen(3)).to(torch.bfloat16)
    wide[:, 512:] = 1e4
    x = wide[:, :512]
    ref = per_token_group_quant_fp8_ref(x, 128)
    for plan in (None, *PLANS):
        got = per_token_group_quant_fp8_triton(x.to(DEVICE), 128, plan=plan)
        assert_bitwise(got, ref, f"strided plan={plan}")


def test_empty_inputs_launch_nothing_and_keep_shapes():
    for tokens, width in ((0, 256), (3, 0)):
        x = torch.zeros(tokens, width, device=DEVICE)
        x_q, x_s = per_token_group_quant_fp8_triton(x, 128 if width else 1)
        assert x_q.shape == (tokens, width) and x_s.shape[0] == tokens


def test_wide_groups_take_the_chunked_kernel_and_match(monkeypatch):
    """A per-token group wider than MAX_TILE_GROUP takes the chunked kernel (and narrower
    ones the tile kernel); both are bitwise the reference."""
    taken = []
    for name in ("_launch_quant_tiles", "_launch_quant_wide_groups"):
        real = getattr(fp8_gemm_triton, name)
        monkeypatch.setattr(
            fp8_gemm_triton, name, lambda *a, _n=name, _r=real, **k: (taken.append(_n), _r(*a, **k))
        )
    wide = MAX_TILE_GROUP + 1024  # pads to 2 * MAX_TILE_GROUP
    for width, kernel in ((wide, "_launch_quant_wide_groups"), (1024, "_launch_quant_tiles")):
        x = stress_input(2, width, width, torch.bfloat16, seed=width)
        taken.clear()
        got = per_token_group_quant_fp8_triton(x.to(DEVICE), width)
        assert taken == [kernel]
        assert_bitwise(got, per_token_group_quant_fp8_ref(x, width), f"per-token K={width}")


@pytest.mark.parametrize(("tokens", "width", "group"), [(9, 512, 128), (6, 288, 96)])
def test_the_benchmark_baseline_gives_the_same_bits(tokens, width, group):
    """The chunked kernel forced at narrow groups (the pre-issue-22 path the benchmark
    times as its baseline) is bitwise the reference too, in both scale layouts."""
    x = stress_input(tokens, width, group, torch.bfloat16, seed=5).to(DEVICE)
    ref = per_token_group_quant_fp8_ref(x.cpu(), group)
    for column_major in (False, True):
        x_q, x_s = nan_outputs(tokens, width, group, column_major)
        fp8_gemm_triton._launch_quant_wide_groups(x, x_q, x_s, group)
        assert_bitwise((x_q, x_s), ref, f"baseline col={column_major}")


def test_plans_are_checked():
    for bad in ((3, 1, 4), (1, 0, 4), (1, 1, 32), (True, 1, 4)):
        with pytest.raises(ValueError):
            QuantPlan(*bad)
    with pytest.raises(ValueError):
        per_token_group_quant_fp8_triton(torch.zeros(1, 128, device=DEVICE), 128, plan=(1, 1, 4))


@pytest.mark.parametrize("tokens", [1, 3, 64, 512, 4096])
@pytest.mark.parametrize(
    ("width", "group"), [(2048, 128), (12288, 128), (96, 32), (4096, 4096), (8, 8), (4096, 2)]
)
def test_chosen_plans_stay_within_one_tile_and_fill_the_gpu(tokens, width, group):
    groups = width // group
    for column_major in (False, True):
        plan = choose_quant_plan(tokens, group, groups, column_major)
        pad = 1 << (group - 1).bit_length()
        tile = plan.block_t * plan.block_g * pad
        assert tile <= max(QUANT_TILE, pad)
        assert plan.block_t <= max(1, 1 << (tokens - 1).bit_length())
        if column_major and pad * 8 <= QUANT_TILE:
            assert plan.block_t >= min(tokens, 8)
        programs = -(-tokens // plan.block_t) * -(-groups // plan.block_g)
        # Too few programs only where the tile cannot shrink further.
        shrinkable = plan.block_g > 1 or plan.block_t > (min(tokens, 8) if column_major else 1)
        if programs < MIN_QUANT_PROGRAMS and shrinkable:
            assert tile <= MIN_QUANT_TILE, f"{plan.name}: {programs} programs"


# ---------------------------------------------------------------- compiled (GPU)

GPU_TOKENS = (1, 64, 512, 4096)
GPU_WIDTHS = (2048, 4096, 12288)


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", GPU_TOKENS)
@pytest.mark.parametrize("width", GPU_WIDTHS)
def test_compiled_quantizer_is_bitwise_the_reference_at_serving_shapes(tokens, width):
    x = stress_input(tokens, width, 128, torch.bfloat16, seed=tokens + width)
    ref = per_token_group_quant_fp8_ref(x, 128)
    on = x.to(DEVICE)
    for column_major in (False, True):
        assert_bitwise(per_token_group_quant_fp8_triton(on, 128, column_major), ref, "chosen")
        for plan in (*PLANS, QuantPlan(1, 32, 8), QuantPlan(8, 4, 8), QuantPlan(1, 8, 4)):
            out = nan_outputs(tokens, width, 128, column_major)
            fp8_gemm_triton._launch_quant_tiles(on, *out, 128, plan)
            assert_bitwise(out, ref, f"{tokens}x{width} plan={plan.name} col={column_major}")
    base_q, base_s = nan_outputs(tokens, width, 128, column_major=False)
    fp8_gemm_triton._launch_quant_wide_groups(on, base_q, base_s, 128)
    assert_bitwise((base_q, base_s), ref, f"{tokens}x{width} baseline")


@gpu
@needs_cuda
@pytest.mark.parametrize("column_major", [False, True])
def test_compiled_quantizer_replays_in_a_cuda_graph(column_major):
    """Captured once, replayed on new activations: bitwise the reference's (no host sync
    in the launch, no data-dependent shape)."""
    x = torch.zeros(300, 4096, device=DEVICE, dtype=torch.bfloat16)
    per_token_group_quant_fp8_triton(x, 128, column_major)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = per_token_group_quant_fp8_triton(x, 128, column_major)
    for seed in (1, 2):
        new = stress_input(300, 4096, 128, torch.bfloat16, seed)
        x.copy_(new.to(DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(out, per_token_group_quant_fp8_ref(new, 128), f"graph seed {seed}")
