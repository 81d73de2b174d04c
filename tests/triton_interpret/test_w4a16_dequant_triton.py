"""The int4 dequantization kernel (kernels/w4a16_dequant_triton.py) against
`w4a16_gemm.dequantize_w4`, bitwise, on fresh random codes and scales: row counts that
are not a multiple of the program's rows, word counts that are not a multiple of its
words, groups of 32 and 128, float32 and half scales, every output dtype. Interpreted on
the CPU (tiny shapes), compiled on a GPU; the `gpu` cases add Qwen3-8B's linear shapes
and the prefill path through `ops.w4a16_linear` (kernels/w4a16_dispatch.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from kvloom.kernels import ops, w4a16_dispatch
from kvloom.kernels.w4a16_gemm import dequantize_w4, pack_int4, w4a16_linear_ref
from tests.kernel_env import DEVICE, gpu, needs_cuda

pytestmark = pytest.mark.skipif(
    os.environ.get("KVLOOM_TRITON_CHECKS_IN_SUBPROCESS") == "1",
    reason="triton was imported for the compiler first (run this module alone)",
)

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpret.conftest import round_bfloat16_like_the_gpu

    round_bfloat16_like_the_gpu()

from kvloom.kernels.w4a16_dequant_triton import dequantize_w4_triton  # noqa: E402


def int4_weight(n, k, group, scale_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=g)
    scale = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).to(scale_dtype)
    return pack_int4(q), scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("n", "k", "group", "scale_dtype"),
    [
        (5, 64, 32, torch.float32),  # fewer rows and words than one program's
        (33, 640, 128, torch.bfloat16),  # a partial row tile, 80 words: a partial word tile
        (16, 1024, 32, torch.float32),  # whole tiles, 32 groups a row
    ],
)
def test_bitwise_the_reference(dtype, n, k, group, scale_dtype):
    packed, scale = int4_weight(n, k, group, scale_dtype, n + k)
    want = dequantize_w4(packed, scale, group, dtype)
    got = dequantize_w4_triton(packed.to(DEVICE), scale.to(DEVICE), group, dtype)
    assert got.dtype == dtype and got.shape == (n, k)
    assert torch.equal(got.cpu(), want)


def test_bad_arguments_name_the_tensor():
    packed, scale = int4_weight(4, 64, 32, torch.float32, 0)
    with pytest.raises(ValueError, match="weight_scale: expected shape"):
        dequantize_w4_triton(packed.to(DEVICE), scale[:, :1].to(DEVICE), 32, torch.bfloat16)
    with pytest.raises(ValueError, match="weight_packed: expected \\[N, K / 8\\]"):
        dequantize_w4_triton(packed[None].to(DEVICE), scale.to(DEVICE), 32, torch.bfloat16)
    with pytest.raises(ValueError, match="weight_packed: expected int32"):
        dequantize_w4_triton(packed.float().to(DEVICE), scale.to(DEVICE), 32, torch.bfloat16)


@gpu
@needs_cuda
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)])
def test_gpu_qwen3_8b_shapes_bitwise_and_through_the_prefill_path(n, k):
    packed, scale = int4_weight(n, k, 128, torch.bfloat16, n)
    packed, scale = packed.to(DEVICE), scale.to(DEVICE)
    want = dequantize_w4(packed, scale, 128, torch.bfloat16)
    assert torch.equal(dequantize_w4_triton(packed, scale, 128, torch.bfloat16), want)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(w4a16_dispatch.DEQUANT_MIN_TOKENS, k, generator=g).to(DEVICE, torch.bfloat16)
    assert w4a16_dispatch.dequant_gemm_blocker(x) is None
    out = ops.w4a16_linear(x, packed, scale, 128)
    ref = w4a16_linear_ref(x, packed, scale, 128, out_dtype=torch.float32)
    # One bf16 rounding of the float32 sum (half an ulp of the value) plus cuBLAS's float32
    # summation order (1e-5 of the output scale).
    bound = ref.abs() * 2**-8 + 1e-5 * ref.abs().max()
    assert ((out.float() - ref).abs() <= bound).all()
