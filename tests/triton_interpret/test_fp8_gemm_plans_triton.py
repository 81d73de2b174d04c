"""The FP8 GEMM's plans (kernels/fp8_gemm_triton.py): every plan against the reference and
bitwise equal to every other (invariant 7), and the plan table by token count.

Plans differ in token tile, weight tile, warps, stages and program order (`group` token
tiles per band). Edge shapes: one token; token counts that are no multiple of any token
tile; N that is no multiple of 64 or 128; several activation groups per row, a group per
K tile of 32, one group per row with a partial K tile; bands of program order cut short
(the test-only plans with group 2 and 3 make that cheap to reach at small shapes).

Without CUDA the kernel runs in Triton's CPU interpreter at small shapes (the conftest
beside this sets TRITON_INTERPRET=1); with CUDA the same tests run compiled, and the
`gpu`-marked one adds Qwen3-8B's width (K = 4096) at 1, 16, 300 and 4096 tokens.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvloom.kernels.fp8_gemm import fp8_linear_ref
from kvloom.kernels.fp8_quant import per_token_group_quant_fp8_ref
from tests.kernel_env import DEVICE, gpu, needs_cuda

pytestmark = pytest.mark.skipif(
    os.environ.get("KVLOOM_TRITON_CHECKS_IN_SUBPROCESS") == "1",
    reason="triton was imported for the compiler first (run this module alone)",
)

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpret.conftest import round_bfloat16_like_the_gpu, round_fp8_like_the_gpu

    round_bfloat16_like_the_gpu()
    round_fp8_like_the_gpu()

from kvloom.kernels.fp8_gemm_triton import (  # noqa: E402 (after the interpreter set-up)
    FP8_GEMM_PLANS,
    PREFILL_MIN_TOKENS,
    PREFILL_PLAN,
    SMALL_PLANS,
    Fp8GemmPlan,
    choose_fp8_gemm_plan,
    fp8_linear_triton,
    fp8_matmul_triton,
)

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
# The table's plans plus two that only tests run: short bands of program order.
PLANS = (*FP8_GEMM_PLANS, Fp8GemmPlan(16, 64, 4, 3, 3), Fp8GemmPlan(32, 128, 8, 2, 2))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fp8_case(tokens, rows, width, group, dtype, seed):
    """(x, e4m3 weight, its float32 group scales, bias), fresh random values."""
    w_q = (torch.randn(rows, width, generator=gen(seed)) * 40).to(torch.float8_e4m3fn)
    w_s = torch.rand(rows, width // group, generator=gen(seed + 1)) * 0.02 + 1e-3
    x = torch.randn(tokens, width, generator=gen(seed + 2)).to(dtype)
    bias = torch.randn(rows, generator=gen(seed + 3)).to(dtype)
    return x, w_q, w_s, bias


def run_plans(x, w_q, w_s, group, bias, out_dtype=None, plans=PLANS):
    """The GEMM (what plans change) in each plan, on activations quantized once by the
    reference (bitwise the Triton quantizer's, tested in test_quant_kernels_triton.py;
    interpreted, the quantizer costs more than the GEMM)."""
    x_q, x_s = per_token_group_quant_fp8_ref(x, group)
    args = [t.to(DEVICE) for t in (x_q, x_s, w_q, w_s)] + [group, bias.to(DEVICE)]
    return [fp8_matmul_triton(*args, out_dtype or x.dtype, plan=p).cpu() for p in plans]


def check(name, outs, ref, dtype, plans=PLANS):
    """Every plan's output bitwise the first's, which is close to the reference."""
    first = outs[0]
    assert not torch.isnan(first).any(), f"{name}: NaN in the kernel's output"
    for plan, out in zip(plans, outs):
        assert torch.equal(out, first), f"{name}: plan {plan.name} differs from {plans[0].name}"
    scale = max(ref.abs().max().item(), 1.0)
    err = (first.double() - ref.double()).abs().max().item()
    print(f"ERRNORM {name}: max_abs={err:.3e} (output scale {scale:.3g})")
    assert err <= TOL[dtype] * scale, f"{name}: max |diff| {err:.3g}"


CASES = [
    # tokens, N, K, group
    (1, 48, 128, 128),  # one token, one weight tile
    (37, 70, 256, 128),  # 37 tokens, N = 70 (partial 64- and 128-row tiles), 2 groups
    (130, 200, 192, 64),  # two 128-token tiles (the second holds 2), 3 groups; short bands
    (21, 33, 96, 32),  # K tile 32 (= the group), 3 groups
    (5, 40, 96, 96),  # one group per row (per-channel), K = 96: a partial 64-column tile
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "rows", "width", "group"), CASES)
def test_every_fp8_gemm_plan_is_bitwise_the_same_and_matches_reference(
    dtype, tokens, rows, width, group
):
    x, w_q, w_s, bias = fp8_case(tokens, rows, width, group, dtype, 100)
    ref = fp8_linear_ref(x, w_q, w_s, group, None, bias)
    outs = run_plans(x, w_q, w_s, group, bias)
    check(f"fp8 plans {tokens}x{rows}x{width}/g{group} {dtype}", outs, ref, dtype)


def test_float32_output_of_bfloat16_activations_in_every_plan():
    """Also through the linear entry (Triton quantizer, then the GEMM in a given plan)."""
    x, w_q, w_s, bias = fp8_case(19, 70, 128, 64, torch.bfloat16, 110)
    outs = run_plans(x, w_q, w_s, 64, bias, torch.float32)
    assert outs[0].dtype == torch.float32
    ref = fp8_linear_ref(x, w_q, w_s, 64, None, bias, torch.float32)
    check("fp8 plans float32 out", outs, ref, torch.float32)
    dev = [t.to(DEVICE) for t in (x, w_q, w_s)]
    linear = fp8_linear_triton(*dev, 64, bias.to(DEVICE), torch.float32, plan=PREFILL_PLAN)
    assert torch.equal(linear.cpu(), outs[0])


def test_a_token_row_does_not_depend_on_its_launch():
    """Chosen plans: rows of a prefill-size launch (PREFILL_PLAN) are bitwise those of a
    70-token launch (the 64-token tile) and of one-token launches (the 16-token tile)."""
    tokens = PREFILL_MIN_TOKENS + 6
    x, w_q, w_s, bias = fp8_case(tokens, 40, 64, 64, torch.bfloat16, 120)
    x_q, x_s = per_token_group_quant_fp8_ref(x, 64)  # per token: slicing rows commutes
    dev = [t.to(DEVICE) for t in (w_q, w_s)] + [64, bias.to(DEVICE), torch.bfloat16]

    def launch(rows):
        return fp8_matmul_triton(x_q[rows].to(DEVICE), x_s[rows].to(DEVICE), *dev).cpu()

    assert choose_fp8_gemm_plan(tokens) == PREFILL_PLAN
    full = launch(slice(None))
    ref = fp8_linear_ref(x, w_q, w_s, 64, None, bias)
    check("fp8 chosen plan, prefill size", [full], ref, torch.bfloat16, (PREFILL_PLAN,))
    assert torch.equal(launch(slice(0, 70)), full[:70])
    for t in (0, 69, tokens - 1):
        assert torch.equal(launch(slice(t, t + 1)), full[t : t + 1]), f"row {t} differs"


def test_plan_table_by_token_count():
    """Up to 64 tokens the choice from before plans (16 tokens per tile up to 16, then 32),
    the 64-token tile below PREFILL_MIN_TOKENS, the prefill plan from there."""
    assert {choose_fp8_gemm_plan(t) for t in (0, 1, 8, 16)} == {SMALL_PLANS[16]}
    assert {choose_fp8_gemm_plan(t) for t in (17, 33, 64)} == {SMALL_PLANS[32]}
    assert {choose_fp8_gemm_plan(t) for t in (65, 256, PREFILL_MIN_TOKENS - 1)} == {SMALL_PLANS[64]}
    assert {choose_fp8_gemm_plan(t) for t in (PREFILL_MIN_TOKENS, 4096, 65536)} == {PREFILL_PLAN}
    assert PREFILL_MIN_TOKENS >= 512
    small = [(p.block_m, p.block_n, p.warps, p.stages, p.group) for p in SMALL_PLANS.values()]
    assert small == [(16, 64, 4, 3, 1), (32, 64, 4, 3, 1), (64, 64, 4, 3, 1)]
    assert len({p.name for p in FP8_GEMM_PLANS}) == len(FP8_GEMM_PLANS)
    assert all(choose_fp8_gemm_plan(t) in FP8_GEMM_PLANS for t in range(0, 5000, 7))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_n": 32}, "block_n"),  # half a wgmma block of weight rows
        ({"warps": 2}, "warps"),  # not a whole warp group
        ({"block_m": 8}, "block_m"),
        ({"stages": 0}, "stages"),
        ({"group": 0}, "group"),
        ({"group": 2.0}, "an int"),
    ],
)
def test_plans_outside_the_bitwise_argument_are_refused(kwargs, match):
    fields = {"block_m": 64, "block_n": 128, "warps": 4, "stages": 3, "group": 1} | kwargs
    with pytest.raises(ValueError, match=match):
        Fp8GemmPlan(**fields)


def test_plan_and_block_m_are_exclusive():
    x, w_q, w_s, bias = fp8_case(2, 16, 64, 64, torch.float32, 130)
    with pytest.raises(ValueError, match="not both"):
        fp8_linear_triton(x, w_q, w_s, 64, plan=PREFILL_PLAN, block_m=16)
    with pytest.raises(ValueError, match="block_m"):
        fp8_linear_triton(x, w_q, w_s, 64, block_m=128)


def test_imprecise_accumulation_is_0_or_32():
    x_q = torch.zeros(2, 64, device=DEVICE).to(torch.float8_e4m3fn)
    x_s = torch.ones(2, 1, device=DEVICE)
    w_q = torch.zeros(16, 64, device=DEVICE).to(torch.float8_e4m3fn)
    w_s = torch.ones(16, 1, device=DEVICE)
    with pytest.raises(ValueError, match="imprecise_acc"):
        fp8_matmul_triton(x_q, x_s, w_q, w_s, 64, imprecise_acc=16)


# ---------------------------------------------------------------- GPU shapes


@gpu
@needs_cuda
@pytest.mark.parametrize(("rows", "width"), [(4096, 4096), (1000, 4096)])
@pytest.mark.parametrize("tokens", [1, 16, 300, 4096])
def test_gpu_every_fp8_gemm_plan_at_qwen3_8b_width(rows, width, tokens):
    """Compiled: Qwen3-8B's o_proj shape (and N = 1000, partial weight tiles), 128-column
    groups, bfloat16; every plan bitwise the first, which matches the reference."""
    x, w_q, w_s, bias = fp8_case(tokens, rows, width, 128, torch.bfloat16, 140)
    outs = run_plans(x, w_q, w_s, 128, bias)
    dev = [t.to(DEVICE) for t in (x, w_q, w_s)]
    ref = fp8_linear_ref(*dev, 128, None, bias.to(DEVICE)).cpu()
    check(f"gpu fp8 plans {rows}x{width} T={tokens}", outs, ref, torch.bfloat16)
