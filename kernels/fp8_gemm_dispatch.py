"""Which GEMM serves a prefill-size FP8 linear: cuBLAS's blockwise-scaled FP8 GEMM
(`torch._scaled_mm` with 1x128 activation scales and 128x128 weight scales) or kvloom's
Triton GEMM (kernels/fp8_gemm_triton.py).

Both compute `fp8_gemm.fp8_linear_ref`'s semantics on the same e4m3 activations (the
Triton quantizer's, bitwise the reference's); cuBLAS sums in its own order, with the FP8
tensor cores' accumulation: its float32 output was 1.5e-4 and 1.9e-4 of the output's
largest magnitude from the float64 product of the served operands on an H200
(benchmarks/scaled_mm_accuracy.py, 2026-12-05), where the Triton GEMM (full-precision
accumulation, `max_num_imprecise_acc=0`) stays within 5e-7; about one bf16 ulp of a
bf16 output. On an H100 (2026-12-05) the 1,000-request offline run of the Qwen3-8B shape
with block-FP8 weights took 31.45 s through cuBLAS and 75.41 s through the Triton GEMM
(vLLM 0.26's CUTLASS kernel: 48.12 s), so cuBLAS is the default
(docs/benchmarks/quantization.md).

`scaled_mm_blocker` names the first reason a call cannot take cuBLAS (None: it can):

- `KVLOOM_SCALED_MM=0` turns it off. (Until 2026-12-05 it was opt-in: a GPU test saw
  4.4e-3 to 8.7e-3 of the output scale against its oracle, which quantized on the GPU,
  where torch's division by a Python number multiplies by the reciprocal; the oracle's
  codes were not the served ones. The reference now divides by a tensor.)
- rows are padded to a multiple of 4: cuBLAS refused 65 tokens (torch checks the
  activation scales' stride is exactly the row count, so the scales cannot be padded
  alone, and cuBLAS needs their 16-byte alignment);
- the deterministic mode keeps the Triton GEMM: cuBLAS picks its algorithm (so its
  summation order) by shape, so a row's result could depend on its batch;
- a GPU of compute capability 9.0: torch runs cuBLAS's 1x128 / 128x128 scaling on Hopper
  only (with cuBLAS >= 12.9);
- the layer keeps its weight scale in 128x128 blocks (`block_scale` [N / 128, K / 128],
  from workers/layers/quantization/methods.py; None where a tensor-parallel shard or a
  fused part splits a block) and groups activations by 128;
- N a multiple of 128 and K of 512: cuBLAS reads the weight's block scales as
  [round_up(K / 128, 4), N / 128] column-major, while `torch._scaled_mm` hands it
  K / 128 rows unpadded (torch pads only in `_scaled_mm_v2`, pytorch PR 166752), so
  K / 128 must itself be a multiple of 4 or the scales are misread, silently;
- at least SCALED_MM_MIN_TOKENS tokens (decode sizes stay on the GEMV and the small
  Triton plans);
- an output in bfloat16 or float32 (the dtypes torch tests blockwise scaling with);
- cuBLAS has not refused this shape before: a refusal (an error from the call) falls
  back to the Triton GEMM, is remembered for the shape and logged once.
"""

from __future__ import annotations

import functools
import logging

import torch

from kvloom.contracts import envs
from kvloom.kernels import dispatch

logger = logging.getLogger(__name__)

ENABLE_ENV = "KVLOOM_SCALED_MM"
ROW_ALIGN = 4  # cuBLAS's alignment of the column-major activation scales (module doc)
BLOCK = 128  # cuBLAS's block: 1x128 activation groups, 128x128 weight blocks
K_BLOCKS_MULTIPLE = 4  # cuBLAS's row padding of the weight's block scales (module doc)
# Fewest tokens that take cuBLAS. It was faster than the Triton GEMM from 16 tokens up
# on the H200 (GEMM alone), but 64 keeps the small plans for decode-size launches.
SCALED_MM_MIN_TOKENS = 64
SCALED_MM_OUT_DTYPES = (torch.bfloat16, torch.float32)
HOPPER = (9, 0)

# (tokens, N, K, output dtype) cuBLAS refused; and the weight shapes already logged.
_refused: set[tuple[int, int, int, torch.dtype]] = set()
_logged: set[tuple[int, int, torch.dtype]] = set()


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device (read once per device), None elsewhere."""
    if device.type != "cuda":
        return None
    return _cuda_capability(torch.cuda.current_device() if device.index is None else device.index)


def scaled_mm_blocker(
    x: torch.Tensor,
    w_q: torch.Tensor,
    group_size: int,
    block_scale: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
) -> str | None:
    """Why y = x W^T cannot take cuBLAS's blockwise GEMM (module docstring), or None."""
    n, k = w_q.shape
    tokens = x.numel() // max(k, 1)
    out_dtype = out_dtype or x.dtype
    if not envs.flag(ENABLE_ENV):
        return f"turned off ({ENABLE_ENV}=0)"
    if dispatch.batch_invariant():
        return "the deterministic mode keeps the batch-invariant Triton GEMM"
    if block_scale is None:
        return "the layer keeps no 128x128 block scale"
    if device_capability(w_q.device) != HOPPER:
        return f"not a compute capability {HOPPER[0]}.{HOPPER[1]} GPU"
    if n % BLOCK or k % (BLOCK * K_BLOCKS_MULTIPLE):
        return f"N ({n}) must be a multiple of {BLOCK} and K ({k}) of {BLOCK * K_BLOCKS_MULTIPLE}"
    blocks = (n // BLOCK, k // BLOCK)
    if group_size != BLOCK or tuple(block_scale.shape) != blocks:
        return f"scales are not {BLOCK}x{BLOCK} blocks with {BLOCK}-column activation groups"
    if block_scale.dtype != torch.float32 or not block_scale.is_contiguous():
        return "the block scale is not contiguous float32"
    if not w_q.is_contiguous():
        return "the weight is not contiguous"
    if tokens < SCALED_MM_MIN_TOKENS:
        return f"{tokens} tokens, below SCALED_MM_MIN_TOKENS ({SCALED_MM_MIN_TOKENS})"
    if out_dtype not in SCALED_MM_OUT_DTYPES:
        return f"output dtype {out_dtype}"
    if (tokens, n, k, out_dtype) in _refused:
        return "cuBLAS refused this shape before"
    return None


def quantize_activations(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """flat [T, K] -> (x_q [T, K] e4m3, x_s [T, K / 128] float32 with strides (1, T))."""
    from kvloom.kernels.fp8_gemm_triton import per_token_group_quant_fp8_triton

    return per_token_group_quant_fp8_triton(flat, BLOCK, column_major_scales=True)


def fp8_linear_scaled_mm(
    x: torch.Tensor,
    w_q: torch.Tensor,
    block_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N] through torch._scaled_mm (raises where cuBLAS refuses).
    A bias is added to the float32 product and rounded once, as the Triton GEMM does
    (cuBLAS's bias epilogue takes no float32 output)."""
    n, k = w_q.shape
    out_dtype = out_dtype or x.dtype
    flat = x.reshape(-1, k)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    pad = -rows % ROW_ALIGN
    if pad:  # zero rows, sliced off below
        flat = torch.nn.functional.pad(flat, (0, 0, 0, pad))
    x_q, x_s = quantize_activations(flat)
    # w_q.t() is column-major [K, N]; block_scale.t() is the [K / 128, N / 128] view
    # torch's 128x128 check wants (strides (1, K / 128)).
    mm_dtype = out_dtype if bias is None else torch.float32
    out = torch._scaled_mm(x_q, w_q.t(), x_s, block_scale.t(), out_dtype=mm_dtype)
    out = out[:rows]
    if bias is not None:
        out = (out + bias.float()).to(out_dtype)
    return out.view(*x.shape[:-1], n)


def try_fp8_linear_scaled_mm(x, w_q, block_scale, bias=None, out_dtype=None):
    """fp8_linear_scaled_mm, or None where cuBLAS refused the call (remembered for the
    shape, so the next call goes straight to the Triton GEMM; logged once per weight
    shape)."""
    try:
        return fp8_linear_scaled_mm(x, w_q, block_scale, bias, out_dtype)
    except (RuntimeError, ValueError) as err:  # cuBLAS's refusals and torch's checks
        n, k = w_q.shape
        dtype = out_dtype or x.dtype
        _refused.add((x.numel() // k, n, k, dtype))
        if (n, k, dtype) not in _logged:
            _logged.add((n, k, dtype))
            logger.warning(
                "FP8 linear N=%d K=%d (%s) at %d tokens: torch._scaled_mm refused (%s); "
                "shapes it refuses take the Triton GEMM from now on",
                n,
                k,
                dtype,
                x.numel() // k,
                str(err).splitlines()[0][:300],
            )
        return None
