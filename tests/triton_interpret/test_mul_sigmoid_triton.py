"""Qwen3-Next's attention output gate in one launch (`mul_sigmoid_triton`: x * sigmoid(g)
with g read in place from the strided [T, H, D] view beside the query) against torch's
`x * torch.sigmoid(gate.reshape(T, -1))` (`mul_sigmoid_ref`): bitwise in bf16 and fp16,
as the kernel rounds sigmoid to the dtype before the product as torch does.

Without CUDA the kernel runs in Triton's CPU interpreter (exp from numpy, not libdevice)
at small shapes; with CUDA compiled, and the `gpu`-marked test adds Qwen3-Next's shape,
where the compiled sigmoid (libdevice expf, correctly rounded division) must give torch's
bits, and a CUDA-graph replay.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvloom.kernels import ops
from kvloom.kernels.activation import mul_sigmoid_ref
from kvloom.kernels.activation_triton import mul_sigmoid_triton
from tests.kernel_env import CUDA, DEVICE, gpu, needs_cuda

pytestmark = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
    reason="triton was imported for the compiler first and there is no GPU",
)


def make_case(tokens, heads, dim, dtype, seed, scale=4.0):
    """(attention output x [T, H * D], gate [T, H, D] strided) as Qwen3NextAttention has
    them: the gate is the second half of each head's [q_h | gate_h] in the q projection."""
    gen = torch.Generator().manual_seed(seed)
    q_gate = (torch.randn(tokens, heads * 2 * dim + 3 * dim, generator=gen) * scale).to(dtype)
    q_gate = q_gate.to(DEVICE)[:, : heads * 2 * dim].view(tokens, heads, 2 * dim)
    gate = q_gate[..., dim:]
    x = (torch.randn(tokens, heads * dim, generator=gen) * scale).to(dtype=dtype, device=DEVICE)
    return x, gate


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,heads,dim", [(1, 4, 64), (2, 3, 80), (7, 2, 256)])
def test_bitwise_torch(tokens, heads, dim, dtype):
    x, gate = make_case(tokens, heads, dim, dtype, seed=tokens * 1000 + heads * 10 + dim)
    assert not gate.is_contiguous()
    x_before, gate_before = x.clone(), gate.clone()
    out = mul_sigmoid_triton(x, gate)
    want = mul_sigmoid_ref(x, gate)
    assert out.shape == want.shape and out.dtype == dtype and out.is_contiguous()
    mismatch = (out != want).sum().item()
    assert mismatch == 0, f"{mismatch} of {out.numel()} elements differ from torch"
    assert torch.equal(x, x_before) and torch.equal(gate, gate_before)
    # Each row takes its own gate: a row alone gives the same bits.
    assert torch.equal(mul_sigmoid_triton(x[-1:], gate[-1:]), out[-1:])


def test_float32_close_and_saturating_gates():
    """float32 (not dispatched, but supported): within a few ulps; gates of +-100 give
    exactly x and 0 (exp overflow / underflow as torch's)."""
    x, gate = make_case(3, 2, 32, torch.float32, seed=5)
    gate[0, 0, :4] = torch.tensor([100.0, -100.0, 0.0, -0.0])
    out = mul_sigmoid_triton(x, gate)
    torch.testing.assert_close(out, mul_sigmoid_ref(x, gate), rtol=3e-7, atol=0.0)
    assert out[0, 0] == x[0, 0] and out[0, 1] == 0.0 and out[0, 2] == x[0, 2] * 0.5


def test_empty_and_bad_arguments():
    x, gate = make_case(0, 2, 16, torch.bfloat16, seed=6)
    assert mul_sigmoid_triton(x, gate).shape == (0, 32)
    x, gate = make_case(2, 2, 16, torch.bfloat16, seed=7)
    with pytest.raises(ValueError, match="^x:"):
        mul_sigmoid_triton(x[:, :16], gate)
    with pytest.raises(ValueError, match="^gate:"):
        mul_sigmoid_triton(x, gate.half())
    with pytest.raises(ValueError, match="^gate:"):
        mul_sigmoid_triton(x, gate.flatten(1))


@pytest.mark.parametrize(
    "tokens,dtype,deterministic,fuses",
    [
        (1, torch.bfloat16, False, True),
        (2, torch.float16, False, True),
        (3, torch.bfloat16, False, False),  # past GEMV_DISPATCH_MAX_M rows
        (1, torch.float32, False, False),  # half precision only
        (1, torch.bfloat16, True, False),  # the deterministic mode
    ],
)
def test_ops_dispatch(monkeypatch, tokens, dtype, deterministic, fuses):
    """ops.mul_sigmoid takes the kernel only at decode; same bits either way."""
    import kvloom.kernels.activation_triton as act
    from kvloom.kernels import dispatch

    calls = []
    kernel = act.mul_sigmoid_triton
    monkeypatch.setattr(act, "mul_sigmoid_triton", lambda *a: (calls.append(1), kernel(*a))[1])
    monkeypatch.setattr(ops, "use_triton", lambda t: t.dtype in ops.TRITON_DTYPES)
    monkeypatch.setattr(dispatch, "_batch_invariant", deterministic)
    x, gate = make_case(tokens, 2, 64, dtype, seed=8)
    out = ops.mul_sigmoid(x, gate)
    assert calls == ([1] if fuses else [])
    assert torch.equal(out, mul_sigmoid_ref(x, gate))


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 2, 256])
def test_gpu_qwen3_next_shape_bitwise_and_cuda_graph(tokens):
    """Qwen3-Next (16 heads of 256 per rank at TP = 1): torch's bits, also replayed."""
    x, gate = make_case(tokens, 16, 256, torch.bfloat16, seed=tokens)
    assert torch.equal(mul_sigmoid_triton(x, gate), mul_sigmoid_ref(x, gate))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = mul_sigmoid_triton(x, gate)
    fresh_x, fresh_gate = make_case(tokens, 16, 256, torch.bfloat16, seed=tokens + 1)
    x.copy_(fresh_x)
    gate.copy_(fresh_gate)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, mul_sigmoid_ref(x, gate))
