"""The quantized-weight kernels' torch references (CPU): the int4 packing against the
format's own library (compressed-tensors), the FP8 references against independent
dequantize-then-matmul formulations, the MoE references against per-expert linears; the
decode GEMVs' weight-only references, and which path `ops` sends each call down."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvloom.kernels.fp8_gemm import fp8_linear_ref
from kvloom.kernels.fp8_moe import fp8_fused_moe_ref
from kvloom.kernels.fp8_quant import FP8_MAX, per_token_group_quant_fp8_ref
from kvloom.kernels.fused_moe import fused_moe_ref
from kvloom.kernels.quant_gemv import fp8_gemv_ref, gemv_group
from kvloom.kernels.w4a16_gemm import dequantize_w4, pack_int4, unpack_int4, w4a16_linear_ref
from kvloom.kernels.w4a16_moe import w4a16_fused_moe_ref
from tests.kernel_env import gpu, needs_cuda


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_int4_packing_is_compressed_tensors_own():
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )

    q = torch.randint(-8, 8, (6, 64), generator=gen(0), dtype=torch.int8)
    packed = pack_int4(q)
    assert torch.equal(packed, pack_to_int32(q, 4))
    assert torch.equal(unpack_int4(packed, 64), unpack_from_int32(packed, 4, torch.Size((6, 64))))
    assert torch.equal(unpack_int4(packed, 64), q)


def test_per_token_group_quant_semantics():
    x = torch.randn(4, 96, generator=gen(1)) * 3
    x[2, 32:64] = 0.0  # an all-zero group keeps a tiny positive scale
    x_q, x_s = per_token_group_quant_fp8_ref(x, 32)
    groups = x.unflatten(1, (3, 32))
    assert torch.equal(x_s, groups.abs().amax(-1).clamp_min(1e-10) / FP8_MAX)
    back = x_q.float().unflatten(1, (3, 32)) * x_s[..., None]
    # e4m3 keeps 3 mantissa bits: half a step is 1/16 of the value's binade.
    assert ((back - groups).abs() <= groups.abs() / 16 + 1e-12).all()
    assert x_q.float().abs().amax() == FP8_MAX  # each group's max lands on 448


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[gpu, needs_cuda])])
def test_per_token_group_scales_are_correctly_rounded_on_every_device(device):
    """amax / 448 rounded once, as the Triton quantizers compute it (div_rn), on the CPU and
    on the GPU, where torch divides by a Python number as a multiplication by its
    reciprocal (the reference did, and its GPU scales were an ulp off in 59% of groups)."""
    x = torch.randn(64, 1024, generator=gen(2))
    _, x_s = per_token_group_quant_fp8_ref(x.to(device), 128)
    amax = x.unflatten(1, (8, 128)).abs().amax(-1)
    exact = (amax.double() / FP8_MAX).float()  # the true quotient, rounded once
    by_reciprocal = amax * torch.tensor(1 / FP8_MAX, dtype=torch.float32)
    assert not torch.equal(by_reciprocal, exact)  # these inputs tell the two apart
    assert torch.equal(x_s.cpu(), exact)


@pytest.mark.parametrize(
    ("group", "static"), [(32, False), (128, False), (256, False), (256, True)]
)
def test_fp8_linear_ref_is_dequantize_then_matmul(group, static):
    g = gen(2)
    x = torch.randn(5, 256, generator=g)
    w_q = (torch.randn(40, 256, generator=g) * 40).to(torch.float8_e4m3fn)
    w_s = torch.rand(40, 256 // group, generator=g) * 0.01 + 1e-3
    input_scale = torch.tensor(0.01) if static else None
    out = fp8_linear_ref(x, w_q, w_s, group, input_scale)
    w = w_q.double() * w_s.double().repeat_interleave(group, dim=1)
    if static:
        x_deq = (x / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn).double() * 0.01
    else:
        x_q, x_s = per_token_group_quant_fp8_ref(x, group)
        x_deq = x_q.double() * x_s.double().repeat_interleave(group, dim=1)
    torch.testing.assert_close(out.double(), x_deq @ w.T, rtol=1e-5, atol=1e-5)


def test_w4a16_linear_ref_is_dequantize_then_matmul():
    g = gen(3)
    packed = pack_int4(torch.randint(-8, 8, (24, 64), generator=g))
    scale = (torch.rand(24, 2, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(3, 64, generator=g, dtype=torch.float64)
    w = unpack_int4(packed, 64).double() * scale.double().repeat_interleave(32, dim=1)
    torch.testing.assert_close(w4a16_linear_ref(x, packed, scale, 32), x @ w.T)


def routing(num_tokens, num_experts, top_k, seed):
    g = gen(seed)
    ids = torch.rand(num_tokens, num_experts, generator=g).argsort(dim=1)[:, :top_k]
    weights = torch.rand(num_tokens, top_k, generator=g) + 0.1
    return weights / weights.sum(1, keepdim=True), ids


def test_w4a16_moe_ref_is_the_float_moe_on_dequantized_experts():
    g = gen(4)
    e, h, i, group = 3, 64, 32, 32
    w13p = pack_int4(torch.randint(-8, 8, (e, 2 * i, h), generator=g))
    w13s = torch.rand(e, 2 * i, h // group, generator=g) * 0.05
    w2p = pack_int4(torch.randint(-8, 8, (e, h, i), generator=g))
    w2s = torch.rand(e, h, i // group, generator=g) * 0.05
    x = torch.randn(7, h, generator=g, dtype=torch.float64)
    weights, ids = routing(7, e, 2, 5)
    ours = w4a16_fused_moe_ref(x, w13p, w13s, w2p, w2s, group, weights.double(), ids)
    w13 = dequantize_w4(w13p, w13s, group, torch.float64)
    w2 = dequantize_w4(w2p, w2s, group, torch.float64)
    expected = torch.zeros_like(x)
    for t in range(7):
        for j in range(2):
            gate_up = w13[ids[t, j]] @ x[t]
            act = F.silu(gate_up[:i]) * gate_up[i:]
            expected[t] += weights[t, j].double() * (w2[ids[t, j]] @ act)
    torch.testing.assert_close(ours, expected)
    assert torch.equal(ours, fused_moe_ref(x, w13, w2, weights.double(), ids))


def test_fp8_moe_ref_is_per_expert_fp8_linears():
    g = gen(6)
    e, h, i = 4, 128, 64
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 30).to(torch.float8_e4m3fn)
    w13s = torch.rand(e, 2 * i, 1, generator=g) * 0.01
    w2 = (torch.randn(e, h, i, generator=g) * 30).to(torch.float8_e4m3fn)
    w2s = torch.rand(e, h, 2, generator=g) * 0.01
    x = torch.randn(9, h, generator=g)
    weights, ids = routing(9, e, 2, 7)
    ours = fp8_fused_moe_ref(x, w13, w13s, w2, w2s, h, 32, weights, ids)
    expected = torch.zeros(9, h)
    for t in range(9):
        for j in range(2):
            ex = ids[t, j]
            gate_up = fp8_linear_ref(x[t : t + 1], w13[ex], w13s[ex], h)
            act = F.silu(gate_up[:, :i]) * gate_up[:, i:]
            expected[t] += weights[t, j] * fp8_linear_ref(act, w2[ex], w2s[ex], 32)[0]
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_reference_shape_errors_name_the_tensor():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="weight_scale: expected shape"):
        w4a16_linear_ref(x, pack_int4(torch.zeros(8, 64, dtype=torch.int8)), torch.ones(8, 3), 32)
    with pytest.raises(ValueError, match="weight: expected torch.float8_e4m3fn"):
        fp8_linear_ref(x, torch.ones(8, 64), torch.ones(8, 1), 64)
    with pytest.raises(ValueError, match="group_size .32. must divide the input width .48."):
        per_token_group_quant_fp8_ref(torch.randn(2, 48), 32)


# ---------------------------------------------------------------- decode GEMVs


def test_fp8_gemv_ref_is_the_dequantized_linear_and_closer_than_the_w8a8_gemm():
    """Weight-only: x times the float32-dequantized weight, bias in float32, one rounding;
    nearer the float64 linear on the dequantized weight than the GEMM, which also rounds
    the activations to e4m3."""
    g = gen(30)
    x = torch.randn(3, 256, generator=g).bfloat16()
    w_q = (torch.randn(40, 256, generator=g) * 40).to(torch.float8_e4m3fn)
    w_s = torch.rand(40, 2, generator=g) * 0.01 + 1e-3
    bias = torch.randn(40, generator=g).bfloat16()
    w32 = w_q.float() * w_s.repeat_interleave(128, dim=1)
    got = fp8_gemv_ref(x, w_q, w_s, 128, bias)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (x.float() @ w32.T + bias.float()).bfloat16())
    exact = x.double() @ (w_q.double() * w_s.double().repeat_interleave(128, dim=1)).T
    exact = exact + bias.double()
    err_gemv = (fp8_gemv_ref(x, w_q, w_s, 128, bias, torch.float32).double() - exact).abs()
    err_gemm = (fp8_linear_ref(x, w_q, w_s, 128, None, bias, torch.float32).double() - exact).abs()
    print(f"ERRNORM gemv {err_gemv.max().item():.3e} vs w8a8 gemm {err_gemm.max().item():.3e}")
    assert err_gemv.max() < 1e-4 * exact.abs().max()
    assert err_gemv.max() * 100 < err_gemm.max()


@pytest.mark.parametrize(
    ("group", "width", "packed", "kernel_group"),
    [(128, 4096, False, 128), (4096, 4096, False, 0), (160, 160, False, 0), (32, 96, False, 32),
     (16, 64, False, 16), (32, 128, True, 32), (128, 256, True, 128), (96, 192, True, None),
     (4, 64, True, None)],
)  # fmt: skip
def test_gemv_group_layouts(group, width, packed, kernel_group):
    assert gemv_group(group, width, packed) == kernel_group


def test_quant_gemv_default_plans_keep_split_k_a_function_of_the_shape():
    from kvloom.kernels.quant_gemv_triton import choose_quant_gemv_plan

    for fmt in ("fp8", "int4"):
        for n, k in ((6144, 4096), (4096, 12288), (24576, 4096)):
            plans = {choose_quant_gemv_plan(m, n, k, fmt) for m in range(1, 9)}
            assert {p.split_k for p in plans} == {1}, (fmt, n, k)  # >= 1.5 programs per SM
        # 512 features in 4-feature blocks are 128 programs: K is split to fill 132 SMs
        assert choose_quant_gemv_plan(1, 512, 4096, fmt).split_k == 2
    with pytest.raises(ValueError, match="rows is outside"):
        choose_quant_gemv_plan(9, 64, 64, "fp8")


def test_quant_gemv_takes_the_measured_plans_at_their_shapes():
    from kvloom.kernels.quant_gemv_triton import (
        QUANT_GEMV_PLAN_TABLE,
        choose_quant_gemv_plan,
        default_quant_gemv_plan,
    )

    by_m = QUANT_GEMV_PLAN_TABLE[("int4", 24576, 4096)]
    assert choose_quant_gemv_plan(1, 24576, 4096, "int4") == by_m[1]
    for m in range(2, 9):  # rows between the measured ones take the next measured plan
        assert choose_quant_gemv_plan(m, 24576, 4096, "int4") == by_m[8]
    assert by_m[1] != default_quant_gemv_plan(24576, 4096, "int4")
    # a shape not in the table keeps the default
    assert choose_quant_gemv_plan(1, 2048, 4096, "fp8") == default_quant_gemv_plan(
        2048, 4096, "fp8"
    )


def _spy_paths(monkeypatch):
    """Replaces each quantized-linear kernel entry with a recorder; returns the calls."""
    from kvloom.kernels import fp8_gemm_triton, ops, quant_gemv_triton, w4a16_gemm_triton

    calls = []
    for module, name in (
        (quant_gemv_triton, "fp8_gemv_triton"),
        (quant_gemv_triton, "w4a16_gemv_triton"),
        (fp8_gemm_triton, "fp8_linear_triton"),
        (w4a16_gemm_triton, "w4a16_linear_triton"),
    ):
        monkeypatch.setattr(module, name, lambda *a, _n=name, **k: calls.append(_n) or _n)
    monkeypatch.setattr(ops, "use_triton", lambda t: True)
    return ops, calls


@pytest.mark.parametrize("rows", [1, 8, 9])
def test_ops_sends_decode_sizes_to_the_quant_gemv(monkeypatch, rows):
    """1..8 rows take the GEMV (both formats), more the GEMM; so do KVLOOM_NO_GEMV=1, the
    deterministic mode, a static FP8 input scale (the reference) and a group the GEMV
    cannot read."""
    ops, calls = _spy_paths(monkeypatch)
    x = torch.randn(rows, 1, 192)
    w8, s8 = torch.zeros(16, 192).to(torch.float8_e4m3fn), torch.ones(16, 3)
    w4, s4 = torch.zeros(16, 24, dtype=torch.int32), torch.ones(16, 3)
    small = "gemv" if rows <= 8 else "linear"
    assert ops.fp8_linear(x, w8, s8, 64) == f"fp8_{small}_triton"
    assert ops.w4a16_linear(x, w4, s4, 64) == f"w4a16_{small}_triton"
    assert ops.w4a16_linear(x, w4, torch.ones(16, 2), 96) == "w4a16_linear_triton"
    monkeypatch.setattr(ops, "batch_invariant", lambda: True)
    assert ops.fp8_linear(x, w8, s8, 64) == "fp8_linear_triton"
    assert ops.w4a16_linear(x, w4, s4, 64) == "w4a16_linear_triton"
    monkeypatch.setattr(ops, "batch_invariant", lambda: False)
    monkeypatch.setenv("KVLOOM_NO_GEMV", "1")
    assert ops.fp8_linear(x, w8, s8, 64) == "fp8_linear_triton"
    calls.clear()
    out = ops.fp8_linear(x, w8, torch.ones(16, 1), 192, input_scale=torch.tensor(1.0))
    assert isinstance(out, torch.Tensor) and not calls  # the reference
