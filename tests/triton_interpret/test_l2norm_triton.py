"""q/k L2 normalisation in one fixed-plan launch (`l2norm_triton.l2norm_rows_triton`),
which the fla wrappers use in place of fla's autotuned l2norm, against the torch reference
(`l2norm.l2norm`, in float32, then rounded to the input's dtype).

Without CUDA the kernel runs in Triton's CPU interpreter at small shapes; with CUDA
compiled, and the `gpu`-marked test adds Kimi-Linear's and Qwen3-Next's head shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvloom.kernels.l2norm import L2NORM_EPS, l2norm, l2norm_rows
from kvloom.kernels.l2norm_triton import ROWS_PER_PROGRAM, l2norm_rows_triton
from tests.kernel_env import CUDA, DEVICE, gpu, needs_cuda

pytestmark = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
    reason="triton was imported for the compiler first and there is no GPU",
)


def strided_heads(tokens, heads, dim, dtype, seed):
    """[T, H, D] heads viewed out of a wider packed row (as q and k sit beside v in the
    conv's output), scaled so the norms are far from 1."""
    g = torch.Generator().manual_seed(seed)
    packed = (torch.randn(tokens, 3 * heads * dim + 5, generator=g) * 3.0).to(dtype)
    return packed.to(DEVICE)[:, 5 : 5 + heads * dim].view(tokens, heads, dim)


def reference(x):
    return l2norm(x.float(), L2NORM_EPS).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens, heads, dim", [(5, 3, 16), (7, 2, 24), (1, 1, 8), (3, 4, 32)])
def test_rows_match_the_reference(tokens, heads, dim, dtype):
    """Row counts not a multiple of ROWS_PER_PROGRAM, a head dim not a power of two,
    strided tokens: each head vector normalised, contiguous out, in the input's dtype."""
    x = strided_heads(tokens, heads, dim, dtype, seed=tokens * 10 + dim)
    assert not x.is_contiguous() or tokens == 1
    y = l2norm_rows_triton(x, L2NORM_EPS)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    tol = 8e-3 if dtype == torch.bfloat16 else 2e-6
    torch.testing.assert_close(y.float(), reference(x).float(), atol=tol, rtol=tol)
    norms = y.float().norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones_like(norms), atol=2 * tol, rtol=0)


def test_more_rows_than_one_program_and_none():
    x = strided_heads(ROWS_PER_PROGRAM + 3, 2, 16, torch.float32, seed=3)
    torch.testing.assert_close(
        l2norm_rows_triton(x, L2NORM_EPS), reference(x), atol=2e-6, rtol=2e-6
    )
    empty = torch.empty(0, 2, 16, device=DEVICE)
    assert l2norm_rows_triton(empty, L2NORM_EPS).shape == (0, 2, 16)


def test_the_dispatcher_keeps_dtypes_and_names_a_bad_shape():
    """On the CPU the torch form: float32 sums, float64 kept, contiguous out."""
    x64 = torch.randn(3, 2, 8, dtype=torch.float64)
    assert l2norm_rows(x64).dtype == torch.float64
    torch.testing.assert_close(l2norm_rows(x64), l2norm(x64))
    xh = strided_heads(4, 2, 8, torch.bfloat16, seed=9).cpu()
    assert torch.equal(l2norm_rows(xh), reference(xh)) and l2norm_rows(xh).is_contiguous()
    with pytest.raises(ValueError, match="x: expected"):
        l2norm_rows(torch.randn(3, 8))


@gpu
@needs_cuda
@pytest.mark.parametrize("heads", [32, 16])  # Kimi-Linear's and Qwen3-Next's key heads
def test_gpu_model_shapes(heads):
    x = strided_heads(4099, heads, 128, torch.bfloat16, seed=heads)
    y = l2norm_rows(x)  # the dispatcher takes the kernel on CUDA
    torch.testing.assert_close(y.float(), reference(x).float(), atol=8e-3, rtol=8e-3)
