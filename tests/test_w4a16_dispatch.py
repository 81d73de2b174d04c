"""Prefill-size W4A16 linears (kernels/w4a16_dispatch.py), on the CPU: which calls
`dequant_gemm_blocker` lets through, each condition flipped in turn, and what
`ops.w4a16_linear` then runs: the weight dequantized once and a dense product (the
Triton dequantization replaced by the reference it matches bitwise,
tests/triton_interpret/test_w4a16_dequant_triton.py), against `w4a16_linear_ref`; the
Triton GEMM (a spy) wherever the blocker names a reason, and the GEMV at decode sizes."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from kvloom.kernels import dispatch, ops, w4a16_dispatch
from kvloom.kernels.w4a16_gemm import dequantize_w4, pack_int4, w4a16_linear_ref

N, K, GROUP = 64, 256, 32
TOKENS = w4a16_dispatch.DEQUANT_MIN_TOKENS


def weight(seed=0):
    g = torch.Generator().manual_seed(seed)
    packed = pack_int4(torch.randint(-8, 8, (N, K), generator=g))
    return packed, torch.rand(N, K // GROUP, generator=g) * 0.02 + 1e-3


def activations(tokens=TOKENS, dtype=torch.bfloat16, seed=1):
    return torch.randn(tokens, K, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture
def cuda_like(monkeypatch):
    """CPU tensors count as CUDA ones; Triton's entry points are recorders (the
    dequantization: the reference, which the kernel matches bitwise)."""
    calls = []
    monkeypatch.setattr(w4a16_dispatch, "on_cuda", lambda x: True)
    monkeypatch.setattr(w4a16_dispatch, "capturing", lambda: False)
    monkeypatch.setattr(ops, "use_triton", lambda t: True)
    monkeypatch.delenv("KVLOOM_W4A16_DEQUANT_GEMM", raising=False)

    def dequant(packed, scale, group, dtype):
        calls.append("dequant")
        return dequantize_w4(packed, scale, group, dtype)

    def gemm(*args, **kwargs):
        calls.append("triton_gemm")
        return w4a16_linear_ref(*args, **kwargs)

    def gemv(*args, **kwargs):
        calls.append("gemv")
        return w4a16_linear_ref(*args, **kwargs)

    for name, attr, fake in (
        ("kvloom.kernels.w4a16_dequant_triton", "dequantize_w4_triton", dequant),
        ("kvloom.kernels.w4a16_gemm_triton", "w4a16_linear_triton", gemm),
        ("kvloom.kernels.quant_gemv_triton", "w4a16_gemv_triton", gemv),
    ):
        module = types.ModuleType(name)
        setattr(module, attr, fake)
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def test_prefill_sizes_dequantize_once_and_match_the_reference(cuda_like):
    packed, scale = weight()
    x = activations()
    bias = torch.randn(N).to(torch.bfloat16)
    out = ops.w4a16_linear(x, packed, scale, GROUP, bias)
    assert cuda_like == ["dequant"]
    ref = w4a16_linear_ref(x, packed, scale, GROUP, bias, torch.float32)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-5 * ref.abs().max()).all()


def test_each_condition_keeps_the_triton_gemm(cuda_like, monkeypatch):
    packed, scale = weight()
    cases = {
        "below DEQUANT_MIN_TOKENS": dict(x=activations(TOKENS - 1)),
        "float32 activations": dict(x=activations(dtype=torch.float32)),
        "float32 output": dict(x=activations(), out_dtype=torch.float32),
    }
    for name, case in cases.items():
        x, out_dtype = case["x"], case.get("out_dtype")
        assert w4a16_dispatch.dequant_gemm_blocker(x, out_dtype) is not None, name
        cuda_like.clear()
        ops.w4a16_linear(x, packed, scale, GROUP, None, out_dtype)
        assert cuda_like == ["triton_gemm"], name
    x = activations()
    assert w4a16_dispatch.dequant_gemm_blocker(x) is None
    monkeypatch.setattr(w4a16_dispatch, "capturing", lambda: True)
    assert "captured" in w4a16_dispatch.dequant_gemm_blocker(x)
    monkeypatch.setattr(w4a16_dispatch, "capturing", lambda: False)
    monkeypatch.setattr(w4a16_dispatch, "on_cuda", lambda x: False)
    assert "CUDA" in w4a16_dispatch.dequant_gemm_blocker(x)
    monkeypatch.setattr(w4a16_dispatch, "on_cuda", lambda x: True)
    monkeypatch.setenv("KVLOOM_W4A16_DEQUANT_GEMM", "0")
    assert "KVLOOM_W4A16_DEQUANT_GEMM=0" in w4a16_dispatch.dequant_gemm_blocker(x)
    monkeypatch.delenv("KVLOOM_W4A16_DEQUANT_GEMM")
    before = dispatch.batch_invariant()
    dispatch.set_batch_invariant(True)
    try:
        assert "deterministic" in w4a16_dispatch.dequant_gemm_blocker(x)
    finally:
        dispatch.set_batch_invariant(before)
    assert w4a16_dispatch.dequant_gemm_blocker(x) is None


def test_decode_sizes_keep_the_gemv(cuda_like):
    packed, scale = weight()
    ops.w4a16_linear(activations(1), packed, scale, GROUP)
    assert cuda_like == ["gemv"]
