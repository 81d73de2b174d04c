"""cuBLAS's blockwise FP8 GEMM in the serving path (kernels/fp8_gemm_dispatch.py).

* The activation quantizer's column-major scales (the layout cuBLAS's 1x128 scaling
  reads): bitwise the reference's values, strides (1, T). Interpreted on the CPU, compiled
  on a GPU.
* `gpu` (an H100/H200, compute capability 9.0): `ops.fp8_linear` with the weight's
  128x128 block scale at 64, 65, 300 and 4,096 tokens on each Qwen3-8B projection takes
  torch._scaled_mm (a spy counts the calls) and matches the float64 product of the same
  quantized operands: bfloat16 output within half a bf16 ulp of the value plus
  ACCUMULATION_TOL of the output scale for cuBLAS's accumulation (twice, once before and
  once through the rounding); float32 output within ACCUMULATION_TOL; and it agrees
  with `fp8_linear_ref` (float32 sums) within the same bound plus the reference's own
  float32 error. The path replays bitwise in a CUDA graph (decode batches of 64 to 256
  rows capture it).
"""

from __future__ import annotations

import os

import pytest
import torch

from kvloom.kernels import fp8_gemm_dispatch, ops
from kvloom.kernels.fp8_gemm import fp8_linear_ref
from kvloom.kernels.fp8_quant import FP8_DTYPE, per_token_group_quant_fp8_ref
from tests.kernel_env import CUDA, DEVICE, gpu, needs_cuda

pytestmark = pytest.mark.skipif(
    os.environ.get("KVLOOM_TRITON_CHECKS_IN_SUBPROCESS") == "1",
    reason="triton was imported for the compiler first (run this module alone)",
)

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpret.conftest import round_bfloat16_like_the_gpu, round_fp8_like_the_gpu

    round_bfloat16_like_the_gpu()
    round_fp8_like_the_gpu()

from kvloom.kernels.fp8_gemm_triton import (  # noqa: E402 (after the interpreter set-up)
    per_token_group_quant_fp8_triton,
)

QWEN3_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # (N, K)
# cuBLAS's accumulation error allowed, relative to the output's largest magnitude.
# Hopper's FP8 tensor cores sum a 128-long K block with fewer bits than float32 (an H100
# probe: products below about 2^-14 of the running sum are dropped; docs/benchmarks/
# gpu_fast_path.md) and cuBLAS adds the blocks in float32, as every FP8 GEMM on these
# GPUs does (vLLM's CUTLASS kernel too). Measured on an H200 against the float64 product
# of the served operands: 1.2e-4 to 2.7e-4 at every Qwen3-8B projection (2026-12-05).
# A misread scale or a flipped e4m3 code costs 4e-3 and more (the 2026-12-05 failures,
# whose oracle quantized differently); the Triton GEMM stays within 5e-7.
ACCUMULATION_TOL = 5e-4
HOPPER = CUDA and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a compute capability 9.0 GPU")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "width"), [(1, 128), (5, 256), (3, 384), (70, 512)])
def test_column_major_scales_are_the_reference_values(dtype, tokens, width):
    x = (torch.randn(tokens, width, generator=gen(tokens)) * 5).to(dtype)
    x[0, :128] = 0.0  # an all-zero group
    ref_q, ref_s = per_token_group_quant_fp8_ref(x, 128)
    got_q, got_s = per_token_group_quant_fp8_triton(x.to(DEVICE), 128, column_major_scales=True)
    assert got_s.shape == ref_s.shape and got_s.stride() == (1, tokens)
    assert torch.equal(got_q.cpu().view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(got_s.cpu(), ref_s)


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [64, 65, 300, 4096])
@pytest.mark.parametrize("width", [4096, 12288])
def test_gpu_quantizer_at_the_serving_widths_is_the_reference(tokens, width):
    """The activation quantizer the cuBLAS path runs (fp8_gemm_dispatch.quantize_activations),
    compiled, at Qwen3-8B's widths: bitwise the reference's codes and scales, the reference
    run on the CPU and on the GPU. Its first run (H100, 2026-12-05) found the reference
    itself device-dependent: on the GPU 59% of its scales were an ulp off (torch divided by
    the Python number 448 as a multiplication by its reciprocal), which flipped the e4m3
    codes behind the prefill test's 0.5-0.9% errors. The reference now divides by a
    tensor."""
    x = torch.randn(tokens, width, generator=gen(tokens)).to(torch.bfloat16)
    ref_q, ref_s = per_token_group_quant_fp8_ref(x, 128)
    quantized = {
        "reference on the GPU": per_token_group_quant_fp8_ref(x.to(DEVICE), 128),
        "serving quantizer": fp8_gemm_dispatch.quantize_activations(x.to(DEVICE)),
    }
    for name, (q, s) in quantized.items():
        flips = (q.cpu().view(torch.uint8) != ref_q.view(torch.uint8)).sum().item()
        scale_diffs = (s.cpu() != ref_s).sum().item()
        assert flips == 0 and scale_diffs == 0, (
            f"{name}: {flips} of {q.numel()} codes and {scale_diffs} of {s.numel()} scales "
            "differ from the CPU reference's"
        )


def fp8_layer(n, k, seed):
    """e4m3 weight, its 128x128 block scale and the per-row scale the loader keeps."""
    g = gen(seed)
    w_q = (torch.randn(n, k, generator=g) * 40).to(FP8_DTYPE).to(DEVICE)
    blocks = (torch.rand(n // 128, k // 128, generator=g) * 0.002 + 1e-4).to(DEVICE)
    return w_q, blocks, blocks.repeat_interleave(128, dim=0).contiguous()


def exact_product(x, w_q, w_s):
    """float64 product of the quantized operands the kernels see (groups of 128)."""
    x_q, x_s = per_token_group_quant_fp8_ref(x, 128)
    out = torch.zeros(x.shape[0], w_q.shape[0], dtype=torch.float64, device=x.device)
    for g in range(x_s.shape[1]):
        cols = slice(g * 128, (g + 1) * 128)
        part = x_q[:, cols].double() @ w_q[:, cols].double().T
        out += part * x_s[:, g, None].double() * w_s[None, :, g].double()
    return out


@pytest.fixture
def scaled_mm_calls(monkeypatch):
    """Counts torch._scaled_mm calls that returned (the real one runs; a refusal raises
    and is not counted); refusals start forgotten."""
    calls = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(args[0].shape)
        return out

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    monkeypatch.setattr(fp8_gemm_dispatch, "_refused", set())
    monkeypatch.setenv("KVLOOM_SCALED_MM", "1")
    return calls


@gpu
@needs_cuda
@needs_hopper
@pytest.mark.parametrize("tokens", [64, 65, 300, 4096])
@pytest.mark.parametrize(("n", "k"), QWEN3_8B)
def test_prefill_sizes_take_cublas_and_match_the_float64_product(scaled_mm_calls, tokens, n, k):
    w_q, blocks, w_s = fp8_layer(n, k, n + k)
    x = torch.randn(tokens, k, generator=gen(tokens)).to(DEVICE, torch.bfloat16)
    assert fp8_gemm_dispatch.scaled_mm_blocker(x, w_q, 128, blocks) is None
    out = ops.fp8_linear(x, w_q, w_s, 128, block_scale=blocks)
    out32 = ops.fp8_linear(x, w_q, w_s, 128, None, None, torch.float32, block_scale=blocks)
    assert len(scaled_mm_calls) == 2, "the serving path did not take torch._scaled_mm"
    exact = exact_product(x, w_q, w_s)
    scale = exact.abs().max().item()
    err32 = (out32.double() - exact).abs().max().item()
    err16 = (out.double() - exact).abs()
    ref = fp8_linear_ref(x, w_q, w_s, 128, None, None, torch.float32).double()
    err_ref = (ref - exact).abs().max().item()
    print(
        f"ERRNORM scaled_mm {n}x{k} T={tokens}: float32 {err32 / scale:.2e}, bf16 "
        f"{err16.max().item() / scale:.2e}, fp8_linear_ref {err_ref / scale:.2e} of the scale"
    )
    assert err32 <= ACCUMULATION_TOL * scale
    # Round to bf16 once: at most 2^-8 of the value; the float32 error counts twice.
    assert (err16 <= exact.abs() * 2**-8 + 2 * ACCUMULATION_TOL * scale).all()
    assert (out32.double() - ref).abs().max().item() <= ACCUMULATION_TOL * scale + err_ref


@gpu
@needs_cuda
@needs_hopper
@pytest.mark.parametrize("tokens", [64, 256])
def test_the_cublas_path_replays_bitwise_in_a_cuda_graph(scaled_mm_calls, tokens):
    w_q, blocks, w_s = fp8_layer(4096, 4096, 1)
    x = torch.randn(tokens, 4096, generator=gen(2)).to(DEVICE, torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up, as CudaStepGraph does
        ops.fp8_linear(x, w_q, w_s, 128, block_scale=blocks)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.fp8_linear(x, w_q, w_s, 128, block_scale=blocks)
    assert len(scaled_mm_calls) == 2, "the captured call did not take torch._scaled_mm"
    x.copy_(torch.randn(tokens, 4096, generator=gen(3)).to(DEVICE, torch.bfloat16))
    graph.replay()
    assert torch.equal(out, ops.fp8_linear(x, w_q, w_s, 128, block_scale=blocks))
