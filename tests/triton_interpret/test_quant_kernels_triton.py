"""The quantized-weight Triton kernels against their torch references, on fresh random
inputs: FP8 activation quantization (bitwise), FP8 and W4A16 GEMMs, the decode GEMVs
(weight-only, on the dequantized weights), FP8 and W4A16 fused MoE; and invariant 7:
every plan (token block / route block size / GEMV tiling) gives bitwise the same output,
and a GEMV row does not depend on the rows beside it. Edge shapes: one token, K not a
multiple of the tile, partial row tiles, odd N, group boundaries, uneven and empty experts.

Without CUDA the kernels run in Triton's CPU interpreter at tiny shapes (tests/conftest.py
sets TRITON_INTERPRET=1); with CUDA the same tests run compiled, and the `gpu`-marked ones
add the Qwen3-Next MoE layer shape (E=512, k=10, H=2048, I=512) and Qwen3-8B's linear
shapes in bfloat16. MoE workspaces are pre-filled with NaN, so an element read before it
is written shows up.

The interpreter's float32 -> e4m3 cast rounds wrongly near a binade's top (126.8 becomes
64 in Triton 3.9.0's interpreter); the GPU's cvt.rn.satfinite and torch round to nearest
even. `round_fp8_like_the_gpu` makes the interpreter round as they do, as the shared
conftest does for bfloat16.

Tolerances: float32 1e-5 relative to the output scale (summation order only); half types
one unit in the last place (1.6e-2 bfloat16), with exact equality measured here.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvloom.kernels.fp8_gemm import fp8_linear_ref
from kvloom.kernels.fp8_moe import fp8_fused_moe_ref
from kvloom.kernels.fp8_quant import per_token_group_quant_fp8_ref
from kvloom.kernels.fused_moe_triton import choose_block_m as choose_route_block
from kvloom.kernels.gemv_triton import GemvPlan
from kvloom.kernels.quant_gemv import fp8_gemv_ref, w4a16_gemv_ref
from kvloom.kernels.w4a16_gemm import dequantize_w4, pack_int4, w4a16_linear_ref
from kvloom.kernels.w4a16_moe import w4a16_fused_moe_ref
from tests.kernel_env import DEVICE, gpu, needs_cuda

pytestmark = pytest.mark.skipif(
    os.environ.get("KVLOOM_TRITON_CHECKS_IN_SUBPROCESS") == "1",
    reason="triton was imported for the compiler first (run this module alone)",
)

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
PLANS = (16, 32, 64)
NAN = float("nan")


if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpret.conftest import round_bfloat16_like_the_gpu, round_fp8_like_the_gpu

    round_bfloat16_like_the_gpu()
    round_fp8_like_the_gpu()

from kvloom.kernels.fp8_gemm_triton import (  # noqa: E402 (after the interpreter set-up)
    fp8_linear_triton,
    per_token_group_quant_fp8_triton,
)
from kvloom.kernels.fp8_moe_triton import choose_fp8_block_m, fp8_fused_moe_triton  # noqa: E402
from kvloom.kernels.quant_gemv_triton import (  # noqa: E402
    QUANT_GEMV_PLAN_TABLE,
    choose_quant_gemv_plan,
    default_quant_gemv_plan,
    fp8_gemv_triton,
    w4a16_gemv_triton,
)
from kvloom.kernels.w4a16_gemm_triton import w4a16_linear_triton  # noqa: E402
from kvloom.kernels.w4a16_moe_triton import w4a16_fused_moe_triton  # noqa: E402


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def on(device_tensor: torch.Tensor) -> torch.Tensor:
    return device_tensor.to(DEVICE)


def check(name, outs, ref, dtype):
    """Every plan's output bitwise equal to the first, which is close to the reference."""
    first = outs[0]
    assert not torch.isnan(first).any(), f"{name}: NaN in the kernel's output"
    for plan, out in zip(PLANS, outs):
        assert torch.equal(out, first), f"{name}: plan {plan} differs from plan {PLANS[0]}"
    scale = max(ref.abs().max().item(), 1.0)
    err = (first.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    print(f"ERRNORM {name}: max_abs={err:.3e} (output scale {scale:.3g})")
    assert err <= TOL[dtype] * scale, f"{name}: max |diff| {err:.3g}"


def fp8_weight(rows, cols, seed, groups):
    g = gen(seed)
    w_q = (torch.randn(rows, cols, generator=g) * 40).to(torch.float8_e4m3fn)
    w_s = torch.rand(rows, groups, generator=g) * 0.02 + 1e-3
    return w_q, w_s


def w4_weight(shape, group, seed, dtype):
    g = gen(seed)
    packed = pack_int4(torch.randint(-8, 8, shape, generator=g))
    scale = torch.rand(*shape[:-1], shape[-1] // group, generator=g) * 0.05 + 0.005
    return packed, scale.to(dtype)


def moe_routing(num_tokens, num_experts, top_k, seed, empty=()):
    """Distinct experts per token; experts in `empty` get no route (uneven loads)."""
    g = gen(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g)
    for e in empty:
        scores[:, e] = -1.0
    ids = scores.argsort(dim=1, descending=True)[:, :top_k]
    weights = torch.rand(num_tokens, top_k, generator=g) + 0.05
    return weights / weights.sum(1, keepdim=True), ids.to(torch.int32)


# ---------------------------------------------------------------- FP8 quantization


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "width", "group"), [(1, 128, 128), (5, 96, 32), (3, 256, 256)])
def test_fp8_activation_quant_is_bitwise_the_reference(dtype, tokens, width, group):
    x = (torch.randn(tokens, width, generator=gen(10)) * 5).to(dtype)
    x[0, :group] = 0.0  # an all-zero group
    ref_q, ref_s = per_token_group_quant_fp8_ref(x, group)
    got_q, got_s = per_token_group_quant_fp8_triton(on(x), group)
    assert torch.equal(got_q.cpu().view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(got_s.cpu(), ref_s)


# ---------------------------------------------------------------- GEMMs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "rows", "width", "group"),
    [(1, 48, 128, 128), (9, 70, 256, 128), (3, 40, 96, 96), (4, 33, 64, 32)],
)
def test_fp8_linear_matches_reference_in_every_plan(dtype, tokens, rows, width, group):
    w_q, w_s = fp8_weight(rows, width, 11, width // group)
    x = torch.randn(tokens, width, generator=gen(12)).to(dtype)
    bias = torch.randn(rows, generator=gen(13)).to(dtype)
    ref = fp8_linear_ref(x, w_q, w_s, group, None, bias)
    args = (on(x), on(w_q), on(w_s), group, on(bias))
    outs = [fp8_linear_triton(*args, block_m=b).cpu() for b in PLANS]
    check(f"fp8_linear {tokens}x{rows}x{width}/g{group} {dtype}", outs, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "rows", "width", "group"), [(1, 48, 96, 32), (9, 70, 256, 128), (3, 64, 64, 32)]
)
def test_w4a16_linear_matches_reference_in_every_plan(dtype, tokens, rows, width, group):
    packed, scale = w4_weight((rows, width), group, 14, dtype)
    x = torch.randn(tokens, width, generator=gen(15)).to(dtype)
    bias = torch.randn(rows, generator=gen(16)).to(dtype)
    ref = w4a16_linear_ref(x, packed, scale, group, bias)
    args = (on(x), on(packed), on(scale), group, on(bias))
    outs = [w4a16_linear_triton(*args, block_m=b).cpu() for b in PLANS]
    check(f"w4a16_linear {tokens}x{rows}x{width}/g{group} {dtype}", outs, ref, dtype)


# ---------------------------------------------------------------- decode GEMVs

# Tilings with one split_k each (outputs must agree bitwise within a split_k): whole and
# partial loop steps (K % block_k), 1..3 chunks per step, pipelined or not.
GEMV_PLANS = {
    1: (GemvPlan(8, 128, 2, 2), GemvPlan(4, 64, 1, 1), GemvPlan(16, 192, 4, 3)),
    2: (GemvPlan(4, 64, 1, 1, split_k=2), GemvPlan(8, 128, 2, 2, split_k=2)),
}
GEMV_CASES = [
    # rows, N (odd: a partial feature block), K, group (128: blocks; 32: several groups
    # per chunk; = K: one group per row, K not a multiple of 64)
    (1, 33, 384, 128),
    (5, 17, 96, 32),
    (8, 9, 160, 160),
]


def quant_gemv_case(fmt, rows, n, k, group, dtype, seed):
    """(launch(x, **kw), reference(x), x) for one weight of format `fmt`, with a bias."""
    x = torch.randn(rows, k, generator=gen(seed)).to(dtype)
    bias = torch.randn(n, generator=gen(seed + 1)).to(dtype)
    if fmt == "fp8":
        w, s = fp8_weight(n, k, seed + 2, k // group)
        kernel, ref = fp8_gemv_triton, fp8_gemv_ref
    else:
        w, s = w4_weight((n, k), group, seed + 2, dtype)
        kernel, ref = w4a16_gemv_triton, w4a16_gemv_ref
    dev = [on(t) for t in (w, s)]

    def launch(x, **kw):
        return kernel(on(x), dev[0], dev[1], group, on(bias), **kw).cpu()

    return launch, lambda x: ref(x, w, s, group, bias), x


def check_close(name, out, ref, dtype):
    assert not torch.isnan(out).any(), f"{name}: NaN in the kernel's output"
    scale = max(ref.abs().max().item(), 1.0)
    err = (out.double() - ref.double()).abs().max().item()
    print(f"ERRNORM {name}: max_abs={err:.3e} (output scale {scale:.3g})")
    assert err <= TOL[dtype] * scale, f"{name}: max |diff| {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "n", "k", "group"), GEMV_CASES)
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quant_gemv_matches_dequantized_reference_in_every_plan(fmt, rows, n, k, group, dtype):
    launch, ref, x = quant_gemv_case(fmt, rows, n, k, group, dtype, 50)
    want = ref(x)
    name = f"{fmt}_gemv {rows}x{n}x{k}/g{group} {dtype}"
    check_close(f"{name} chosen plan", launch(x), want, dtype)
    for split_k, plans in GEMV_PLANS.items():
        outs = [launch(x, plan=plan) for plan in plans]
        check_close(f"{name} split_k={split_k}", outs[0], want, dtype)
        for plan, out in zip(plans, outs):
            assert torch.equal(out, outs[0]), f"{name}: plan {plan.name} differs from the first"


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_measured_quant_gemv_plans_give_the_default_plans_bits(fmt):
    """Each distinct plan of QUANT_GEMV_PLAN_TABLE (measured at Qwen3-8B's shapes) on a
    small layer: bitwise the default plan's output (same split_k), and near the reference."""
    table_plans = {
        plan
        for (f, _, _), by_m in QUANT_GEMV_PLAN_TABLE.items()
        if f == fmt
        for plan in by_m.values()
    }
    assert table_plans, f"no measured {fmt} plans"
    launch, ref, x = quant_gemv_case(fmt, 3, 33, 1152, 128, torch.bfloat16, 65)
    default = launch(x, plan=default_quant_gemv_plan(33, 1152, fmt))
    check_close(f"{fmt}_gemv default plan", default, ref(x), torch.bfloat16)
    for plan in sorted(table_plans, key=lambda p: p.name):
        assert plan.split_k == 1
        assert torch.equal(launch(x, plan=plan), default), f"{fmt}: plan {plan.name} differs"


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quant_gemv_row_is_independent_of_its_batch(fmt):
    """Row t of an 8-row launch is bitwise a 1-row launch on that row (chosen plans: the
    table may give each row count its own tiling, never its own split_k)."""
    launch, _, x = quant_gemv_case(fmt, 8, 33, 384, 128, torch.bfloat16, 60)
    batch = launch(x)
    for t in range(8):
        assert torch.equal(batch[t], launch(x[t : t + 1])[0]), f"{fmt}: row {t} differs"
    assert len({choose_quant_gemv_plan(m, 33, 384, fmt).split_k for m in range(1, 9)}) == 1


def test_quant_gemv_float32_output_of_bfloat16_activations():
    """out_dtype float32: the sum is rounded once, to float32 (no bfloat16 step)."""
    x = torch.randn(2, 96, generator=gen(70)).bfloat16()
    bias = torch.randn(17, generator=gen(71)).bfloat16()
    w, s = fp8_weight(17, 96, 72, 3)
    out = fp8_gemv_triton(on(x), on(w), on(s), 32, on(bias), torch.float32).cpu()
    assert out.dtype == torch.float32
    ref = fp8_gemv_ref(x, w, s, 32, bias, torch.float32)
    check_close("fp8_gemv float32 out", out, ref, torch.float32)


# ---------------------------------------------------------------- fused MoE

MOE_CASES = [
    # tokens, experts, top_k, hidden, inter, empty experts
    (1, 4, 2, 64, 32, ()),
    (11, 5, 3, 128, 32, (2,)),
    (6, 8, 2, 64, 64, (0, 5, 6)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden", "inter", "empty"), MOE_CASES)
def test_w4a16_moe_matches_reference_in_every_plan(
    dtype, tokens, experts, top_k, hidden, inter, empty
):
    group = 32
    w13p, w13s = w4_weight((experts, 2 * inter, hidden), group, 17, dtype)
    w2p, w2s = w4_weight((experts, hidden, inter), group, 18, dtype)
    x = torch.randn(tokens, hidden, generator=gen(19)).to(dtype)
    weights, ids = moe_routing(tokens, experts, top_k, 20, empty)
    ref = w4a16_fused_moe_ref(x, w13p, w13s, w2p, w2s, group, weights, ids)
    args = [on(t) for t in (x, w13p, w13s, w2p, w2s)] + [group, on(weights), on(ids)]
    outs = [w4a16_fused_moe_triton(*args, block_m=b, _fill=NAN).cpu() for b in PLANS]
    check(f"w4a16_moe T={tokens} E={experts} {dtype}", outs, ref, dtype)


def zero_point_offsets(scale: torch.Tensor, seed: int) -> torch.Tensor:
    """AWQ's zero points as kvloom keeps them: float32 s * (z - 8), z in [0, 15]."""
    zeros = torch.randint(-8, 8, scale.shape, generator=gen(seed)).float()
    return scale.float() * zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden", "inter", "empty"), MOE_CASES[1:])
def test_w4a16_moe_with_zero_points_matches_reference_in_every_plan(
    dtype, tokens, experts, top_k, hidden, inter, empty
):
    """AWQ experts: the weight q * s - o in the tile, as the reference dequantizes it (and
    not the symmetric answer: the offsets are large enough to move every output)."""
    group = 32
    w13p, w13s = w4_weight((experts, 2 * inter, hidden), group, 21, dtype)
    w2p, w2s = w4_weight((experts, hidden, inter), group, 22, dtype)
    w13o, w2o = zero_point_offsets(w13s, 23), zero_point_offsets(w2s, 24)
    x = torch.randn(tokens, hidden, generator=gen(25)).to(dtype)
    weights, ids = moe_routing(tokens, experts, top_k, 26, empty)
    offsets = dict(w13_offset=w13o, w2_offset=w2o)
    ref = w4a16_fused_moe_ref(x, w13p, w13s, w2p, w2s, group, weights, ids, **offsets)
    symmetric = w4a16_fused_moe_ref(x, w13p, w13s, w2p, w2s, group, weights, ids)
    assert not torch.allclose(ref, symmetric, rtol=1e-2, atol=1e-2)
    args = [on(t) for t in (x, w13p, w13s, w2p, w2s)] + [group, on(weights), on(ids)]
    on_offsets = {k: on(v) for k, v in offsets.items()}
    outs = [w4a16_fused_moe_triton(*args, **on_offsets, block_m=b, _fill=NAN).cpu() for b in PLANS]
    check(f"w4a16_moe zero points T={tokens} E={experts} {dtype}", outs, ref, dtype)


def test_w4a16_moe_offsets_come_in_pairs_shaped_as_the_scales():
    w13p, w13s = w4_weight((2, 64, 64), 32, 27, torch.float32)
    w2p, w2s = w4_weight((2, 64, 32), 32, 28, torch.float32)
    x, (weights, ids) = torch.randn(3, 64), moe_routing(3, 2, 1, 29, ())
    args = (x, w13p, w13s, w2p, w2s, 32, weights, ids)
    with pytest.raises(ValueError, match="give both"):
        w4a16_fused_moe_ref(*args, w13_offset=w13s.float())
    with pytest.raises(ValueError, match="w2_offset: expected the scale's shape"):
        w4a16_fused_moe_ref(*args, w13_offset=w13s.float(), w2_offset=w13s.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden", "inter", "empty"), MOE_CASES)
def test_fp8_moe_matches_reference_in_every_plan(
    dtype, tokens, experts, top_k, hidden, inter, empty
):
    g13, g2 = min(hidden, 64), 32
    w13, w13s = fp8_weight(experts * 2 * inter, hidden, 21, hidden // g13)
    w2, w2s = fp8_weight(experts * hidden, inter, 22, inter // g2)
    w13, w13s = w13.view(experts, 2 * inter, hidden), w13s.view(experts, 2 * inter, -1) * 0.2
    w2, w2s = w2.view(experts, hidden, inter), w2s.view(experts, hidden, -1) * 0.2
    x = torch.randn(tokens, hidden, generator=gen(23)).to(dtype)
    weights, ids = moe_routing(tokens, experts, top_k, 24, empty)
    ref = fp8_fused_moe_ref(x, w13, w13s, w2, w2s, g13, g2, weights, ids)
    args = [on(t) for t in (x, w13, w13s, w2, w2s)] + [g13, g2, on(weights), on(ids)]
    outs = [fp8_fused_moe_triton(*args, block_m=b, _fill=NAN).cpu() for b in PLANS]
    check(f"fp8_moe T={tokens} E={experts} {dtype}", outs, ref, dtype)


def test_route_block_plan_by_token_count_at_the_qwen3_next_shape():
    """E=512, k=10: decode sizes (up to the largest CUDA-graph batch) keep the narrow
    16-row plan the graphs capture; prefill chunks get wider blocks."""
    assert {choose_route_block(t, 10, 512) for t in (1, 8, 64, 256, 409)} == {16}
    assert choose_route_block(1024, 10, 512) == 32
    assert choose_route_block(1536, 10, 512) == 64


def test_fp8_route_block_follows_its_own_measured_table():
    """FP8's table (docs/benchmarks/quantization.md): 16-row blocks up to 2 routes per
    expert, 32 above; 64 never won at any size on the H200."""
    assert {choose_fp8_block_m(t, 10, 512) for t in (1, 16, 64, 102)} == {16}
    assert {choose_fp8_block_m(t, 10, 512) for t in (103, 128, 512, 1536, 8192)} == {32}


# ---------------------------------------------------------------- GPU shapes


@gpu
@needs_cuda
@pytest.mark.parametrize("zero_points", [False, True])  # True: AWQ's offsets
@pytest.mark.parametrize("tokens", [1, 16, 1536])
def test_gpu_w4a16_moe_qwen3_next_shape(tokens, zero_points):
    e, k, h, i, group, dtype = 512, 10, 2048, 512, 32, torch.bfloat16
    w13p, w13s = w4_weight((e, 2 * i, h), group, 30, dtype)
    w2p, w2s = w4_weight((e, h, i), group, 31, dtype)
    x = torch.randn(tokens, h, generator=gen(32)).to(dtype)
    weights, ids = moe_routing(tokens, e, k, 33)
    args = [on(t) for t in (x, w13p, w13s, w2p, w2s)] + [group, on(weights), on(ids)]
    offsets = {}
    if zero_points:
        offsets = dict(w13_offset=on(zero_point_offsets(w13s, 34)),
                       w2_offset=on(zero_point_offsets(w2s, 35)))  # fmt: skip
    outs = [w4a16_fused_moe_triton(*args, **offsets, block_m=b).cpu() for b in PLANS]
    ref = w4a16_fused_moe_ref(*args, **offsets).cpu() if tokens <= 16 else outs[0]
    check(f"gpu w4a16_moe T={tokens} zero points {zero_points}", outs, ref, dtype)


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 16, 1536])
def test_gpu_fp8_moe_qwen3_next_shape(tokens):
    e, k, h, i, dtype = 512, 10, 2048, 512, torch.bfloat16
    w13, w13s = fp8_weight(e * 2 * i, h, 34, h // 128)
    w2, w2s = fp8_weight(e * h, i, 35, i // 128)
    w13, w13s = w13.view(e, 2 * i, h), w13s.view(e, 2 * i, -1) * 0.05
    w2, w2s = w2.view(e, h, i), w2s.view(e, h, -1) * 0.05
    x = torch.randn(tokens, h, generator=gen(36)).to(dtype)
    weights, ids = moe_routing(tokens, e, k, 37)
    args = [on(t) for t in (x, w13, w13s, w2, w2s)] + [128, 128, on(weights), on(ids)]
    outs = [fp8_fused_moe_triton(*args, block_m=b).cpu() for b in PLANS]
    ref = fp8_fused_moe_ref(*args).cpu() if tokens <= 16 else outs[0]
    check(f"gpu fp8_moe T={tokens}", outs, ref, dtype)


@gpu
@needs_cuda
@pytest.mark.parametrize(
    ("rows", "width"), [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
)
@pytest.mark.parametrize("tokens", [1, 256])
def test_gpu_qwen3_8b_linear_shapes(rows, width, tokens):
    dtype = torch.bfloat16
    w_q, w_s = fp8_weight(rows, width, 38, width // 128)
    x = torch.randn(tokens, width, generator=gen(39)).to(dtype)
    ref = fp8_linear_ref(on(x), on(w_q), on(w_s), 128).cpu()
    outs = [fp8_linear_triton(on(x), on(w_q), on(w_s), 128, block_m=b).cpu() for b in PLANS]
    check(f"gpu fp8_linear {rows}x{width} T={tokens}", outs, ref, dtype)
    packed, scale = w4_weight((rows, width), 128, 40, dtype)
    ref = w4a16_linear_ref(on(x), on(packed), on(scale), 128).cpu()
    outs = [w4a16_linear_triton(on(x), on(packed), on(scale), 128, block_m=b).cpu() for b in PLANS]
    check(f"gpu w4a16_linear {rows}x{width} T={tokens}", outs, ref, dtype)


@gpu
@needs_cuda
@pytest.mark.parametrize("scheme", ["w4a16", "fp8"])
def test_gpu_quantized_moe_decode_plan_replays_in_a_cuda_graph(scheme):
    """A decode-size launch captured in a CUDA graph (the 16-row plan), replayed on new
    tokens and routing copied into its inputs, equals an eager launch bitwise."""
    e, k, h, i, dtype = 512, 10, 2048, 512, torch.bfloat16
    if scheme == "w4a16":
        weights = [on(t) for t in (*w4_weight((e, 2 * i, h), 32, 41, dtype),
                                   *w4_weight((e, h, i), 32, 42, dtype))]  # fmt: skip

        def launch(x, w, ids):
            return w4a16_fused_moe_triton(x, *weights, 32, w, ids)
    else:
        w13, w13s = fp8_weight(e * 2 * i, h, 43, h // 128)
        w2, w2s = fp8_weight(e * h, i, 44, i // 128)
        weights = [on(w13.view(e, 2 * i, h)), on(w13s.view(e, 2 * i, -1) * 0.05),
                   on(w2.view(e, h, i)), on(w2s.view(e, h, -1) * 0.05)]  # fmt: skip

        def launch(x, w, ids):
            return fp8_fused_moe_triton(x, *weights, 128, 128, w, ids)

    def inputs(seed):
        x = torch.randn(8, h, generator=gen(seed)).to(dtype)
        w, ids = moe_routing(8, e, k, seed + 1)
        return [on(x), on(w), on(ids)]

    static = inputs(45)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch(*static)  # compile, warm up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = launch(*static)
    new = inputs(46)
    for dst, src in zip(static, new):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, launch(*new)), f"{scheme}: graph replay differs"


QWEN3_8B_LINEARS = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


@gpu
@needs_cuda
@pytest.mark.parametrize(("rows", "width"), QWEN3_8B_LINEARS)
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_gpu_quant_gemv_qwen3_8b_shapes(fmt, rows, width):
    """Compiled at Qwen3-8B's widths: 1 and 8 rows against the reference, row 3 of the
    8-row launch bitwise its 1-row launch, and another tiling of the same split_k bitwise
    the chosen one."""
    launch, ref, x = quant_gemv_case(fmt, 8, rows, width, 128, torch.bfloat16, 80)
    batch = launch(x)
    check_close(f"gpu {fmt}_gemv {rows}x{width} M=8", batch, ref(x), torch.bfloat16)
    one = launch(x[3:4])
    check_close(f"gpu {fmt}_gemv {rows}x{width} M=1", one, ref(x[3:4]), torch.bfloat16)
    assert torch.equal(batch[3], one[0]), "row 3 depends on its batch"
    chosen = choose_quant_gemv_plan(1, rows, width, fmt)
    other = GemvPlan(16, 128, 4, 3, chosen.split_k)
    assert torch.equal(launch(x[3:4], plan=other), one), f"plan {other.name} differs"


@gpu
@needs_cuda
@pytest.mark.parametrize("group", [128, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_int4_gemv_weights_are_the_references_bits(dtype, group):
    """Compiled, the int4 GEMV dequantizes in 16-bit arithmetic (gemv_triton's
    HALF_DEQUANT); the interpreter takes the float32 route. One-hot activation rows read
    single weights back (every other product is an exact zero): each must be
    dequantize_w4's bits, for scales from subnormal-product sizes to large."""
    n, k = 64, 512
    packed, scale = w4_weight((n, k), group, 95, torch.float32)
    magnitudes = torch.tensor([1e-7, 1e-4, 1.0, 300.0]).repeat_interleave(n // 4)
    scale = (scale * magnitudes[:, None]).to(dtype)
    expected = dequantize_w4(packed, scale, group, dtype).float()
    packed, scale = on(packed), on(scale)
    for first in range(0, k, 8):
        x = torch.zeros(8, k, dtype=dtype)
        x[torch.arange(8), first + torch.arange(8)] = 1.0
        got = w4a16_gemv_triton(on(x), packed, scale, group, out_dtype=torch.float32)
        want = expected[:, first : first + 8].T
        assert torch.equal(got.cpu(), want), f"columns {first}..{first + 7} differ"


@gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_gpu_quant_gemv_replays_in_a_cuda_graph(fmt):
    """A 1-row launch (through ops, as the layers call it) captured in a CUDA graph and
    replayed on new activations equals an eager launch bitwise."""
    from kvloom.kernels import ops

    n, k, dtype = 6144, 4096, torch.bfloat16
    w, s = fp8_weight(n, k, 90, k // 128) if fmt == "fp8" else w4_weight((n, k), 128, 90, dtype)
    w, s = on(w), on(s)
    linear, gemv = (
        (ops.fp8_linear, fp8_gemv_triton) if fmt == "fp8" else (ops.w4a16_linear, w4a16_gemv_triton)
    )

    def launch(x):
        return linear(x, w, s, 128)

    static = on(torch.randn(1, k, generator=gen(91)).to(dtype))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch(static)  # compile, warm up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = launch(static)
    static.copy_(on(torch.randn(1, k, generator=gen(92)).to(dtype)))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, launch(static)), f"{fmt}: graph replay differs"
    assert torch.equal(graph_out, gemv(static, w, s, 128)), "ops did not take the GEMV"
