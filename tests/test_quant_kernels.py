"""The quantized-weight kernels' torch references (CPU): the int4 packing against the
format's own library (compressed-tensors), the FP8 references against independent
dequantize-then-matmul formulations, the MoE references against per-expert linears."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvloom.kernels.fp8_gemm import fp8_linear_ref
from kvloom.kernels.fp8_moe import fp8_fused_moe_ref
from kvloom.kernels.fp8_quant import FP8_MAX, per_token_group_quant_fp8_ref
from kvloom.kernels.fused_moe import fused_moe_ref
from kvloom.kernels.w4a16_gemm import dequantize_w4, pack_int4, unpack_int4, w4a16_linear_ref
from kvloom.kernels.w4a16_moe import w4a16_fused_moe_ref


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
