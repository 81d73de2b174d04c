"""KDA's output norm in one launch (`kda_gated_norm_triton`: weight * rmsnorm(x) *
sigmoid(gate) per head, in float32) against the torch composition it replaces
(`kda_gated_norm_ref`, Kimi-Linear's GatedRMSNorm as it was).

Not bitwise by design: the kernel's sum of squares is order-free and its 1 / sqrt and exp
are correctly rounded or within a few float32 ulps, where torch's differ in their last
bits; the final rounding to half precision hides that except where it flips a rounding.
So: every element equal or one ulp of the output dtype away, and nearly all equal.

Without CUDA the kernel runs in Triton's CPU interpreter at small shapes; with CUDA
compiled, and the `gpu`-marked test adds Kimi-Linear's shape (32 heads x 128) and a
CUDA-graph replay.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvloom.kernels import ops
from kvloom.kernels.kda_gated_norm import kda_gated_norm_ref
from kvloom.kernels.kda_gated_norm_triton import kda_gated_norm_triton
from tests.kernel_env import CUDA, DEVICE, gpu, needs_cuda

pytestmark = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
    reason="triton was imported for the compiler first and there is no GPU",
)
EPS = 1e-5


def make_case(tokens, heads, dim, dtype, seed, scale=3.0):
    """x [T, H, D] (the recurrence's output), gate [T, H, D] as a strided view (rows of
    a wider buffer), weight [D] around 1."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, heads, dim, generator=gen) * scale).to(dtype)
    wide = (torch.randn(tokens, heads, dim + 5, generator=gen) * scale).to(dtype)
    weight = (1.0 + 0.3 * torch.randn(dim, generator=gen)).to(dtype)
    return x.to(DEVICE), wide.to(DEVICE)[..., :dim], weight.to(DEVICE)


def ulps_apart(out: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|out - want| in units of the spacing of out's dtype at want."""
    step = (torch.nextafter(want, torch.full_like(want, float("inf"))) - want).float()
    return (out.float() - want.float()).abs() / step


def check_close(out, want, name):
    """Equal but for rare one-ulp rounding flips."""
    assert out.shape == want.shape and out.dtype == want.dtype, name
    assert not torch.isnan(out).any(), f"{name}: NaN (an element left unwritten?)"
    far = ulps_apart(out, want)
    assert far.max().item() <= 1.0, f"{name}: {far.max().item()} ulps from torch"
    flips = (out != want).sum().item()
    assert flips <= max(1, out.numel() // 100), f"{name}: {flips} of {out.numel()} differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,heads,dim", [(1, 4, 64), (2, 3, 80), (7, 2, 128)])
def test_matches_torch(tokens, heads, dim, dtype):
    x, gate, weight = make_case(tokens, heads, dim, dtype, seed=tokens * 100 + heads + dim)
    assert not gate.is_contiguous()
    before = [t.clone() for t in (x, gate, weight)]
    out = kda_gated_norm_triton(x, gate, weight, EPS)
    assert out.is_contiguous()
    check_close(out, kda_gated_norm_ref(x, gate, weight, EPS), f"{tokens}x{heads}x{dim}")
    assert all(torch.equal(a, b) for a, b in zip((x, gate, weight), before))
    # A row's answer does not depend on the batch: the last token alone gives its bits.
    assert torch.equal(kda_gated_norm_triton(x[-1:], gate[-1:], weight, EPS), out[-1:])


def test_float32_and_extreme_gates():
    """float32 (supported, not dispatched): within a few float32 ulps; a gate of +100 or
    -100 gives the normed value or exactly 0, and a zero row gives zeros (eps)."""
    x, gate, weight = make_case(3, 2, 32, torch.float32, seed=5)
    gate[0, 0, :2] = torch.tensor([100.0, -100.0])
    x[1, 1] = 0.0
    out = kda_gated_norm_triton(x, gate, weight, EPS)
    want = kda_gated_norm_ref(x, gate, weight, EPS)
    torch.testing.assert_close(out, want, rtol=2e-6, atol=0.0)
    assert out[0, 0, 1] == 0.0 and torch.equal(out[1, 1], torch.zeros_like(out[1, 1]))


def test_empty_and_bad_arguments():
    x, gate, weight = make_case(0, 2, 16, torch.bfloat16, seed=6)
    assert kda_gated_norm_triton(x, gate, weight, EPS).shape == (0, 2, 16)
    x, gate, weight = make_case(2, 2, 16, torch.bfloat16, seed=7)
    with pytest.raises(ValueError, match="^gate:"):
        kda_gated_norm_triton(x, gate[:, :1], weight, EPS)
    with pytest.raises(ValueError, match="^weight:"):
        kda_gated_norm_triton(x, gate, weight[:8], EPS)
    with pytest.raises(ValueError, match="^x:"):
        kda_gated_norm_triton(x.flatten(1), gate, weight, EPS)
    with pytest.raises(ValueError, match="eps"):
        kda_gated_norm_triton(x, gate, weight, -1.0)
    with pytest.raises(ValueError, match="^x:"):
        kda_gated_norm_triton(x.double(), gate, weight, EPS)


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
    """ops.kda_gated_norm takes the kernel only at decode; the reference elsewhere."""
    import kvloom.kernels.kda_gated_norm_triton as kernel_module
    from kvloom.kernels import dispatch

    calls = []
    kernel = kernel_module.kda_gated_norm_triton
    counted = lambda *a: (calls.append(1), kernel(*a))[1]  # noqa: E731
    monkeypatch.setattr(kernel_module, "kda_gated_norm_triton", counted)
    monkeypatch.setattr(ops, "use_triton", lambda t: t.dtype in ops.TRITON_DTYPES)
    monkeypatch.setattr(dispatch, "_batch_invariant", deterministic)
    x, gate, weight = make_case(tokens, 2, 64, dtype, seed=8)
    out = ops.kda_gated_norm(x, gate, weight, EPS)
    assert calls == ([1] if fuses else [])
    want = kda_gated_norm_ref(x, gate, weight, EPS)
    if fuses:
        check_close(out, want, "dispatched")
    else:
        assert torch.equal(out, want)


def test_layer_module_dispatches_through_ops(monkeypatch):
    """KDA's GatedRMSNorm is ops.kda_gated_norm: on the CPU, the reference's bits."""
    from kvloom.workers.layers.kda_layer import GatedRMSNorm

    x, gate, weight = make_case(2, 3, 32, torch.bfloat16, seed=9)
    norm = GatedRMSNorm(32, EPS, torch.bfloat16).to(DEVICE)
    norm.weight.data.copy_(weight)
    assert torch.equal(norm(x, gate), ops.kda_gated_norm(x, gate, weight, EPS))
    if not CUDA:
        assert torch.equal(norm(x, gate), kda_gated_norm_ref(x, gate, weight, EPS))


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 2, 256])
def test_gpu_kimi_linear_shape_and_cuda_graph(tokens):
    """Kimi-Linear (32 KDA heads of 128 at TP = 1): within an ulp of torch's composition
    on the GPU, and a CUDA-graph replay gives the eager launch's bits on fresh inputs."""
    x, gate, weight = make_case(tokens, 32, 128, torch.bfloat16, seed=tokens)
    check_close(
        kda_gated_norm_triton(x, gate, weight, EPS), kda_gated_norm_ref(x, gate, weight, EPS), "gpu"
    )
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = kda_gated_norm_triton(x, gate, weight, EPS)
    fresh_x, fresh_gate, _ = make_case(tokens, 32, 128, torch.bfloat16, seed=tokens + 1)
    x.copy_(fresh_x)
    gate.copy_(fresh_gate)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, kda_gated_norm_triton(x, gate, weight, EPS))
