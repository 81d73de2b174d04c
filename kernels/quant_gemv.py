"""Small-M linear layers with quantized weights (FP8 e4m3 with group scales, W4A16 int4):
the pure-torch references of `quant_gemv_triton`, the decode path of `ops.fp8_linear` /
`ops.w4a16_linear` at 1..QUANT_GEMV_MAX_M rows.

Both dequantize the weight and use the activations as they are (weight-only):

* FP8: w = w_q * w_s[n, k // group] in float32 (each e4m3 value times its float32 group
  scale, rounded once to float32). The activations are NOT quantized, unlike the W8A8
  GEMM (`fp8_gemm.fp8_linear_ref`), which rounds every activation to e4m3 in its token
  group (up to 2^-4 relative per element). So this path is closer to the dequantized
  checkpoint's float linear layer than the GEMM is: its only errors are float32 sums and
  the final rounding. A request's FP8 logits therefore shift a little when its batch
  crosses QUANT_GEMV_MAX_M rows (as bf16's do between the GEMV and cuBLAS).
* W4A16: exactly `w4a16_gemm.w4a16_linear_ref`: (q - 8) * scale formed in float32 and
  rounded once to the activations' dtype.

Then, as `gemv.gemv_ref`: float32 products and sum (float64 inputs stay float64), the bias
added in float32, one rounding to `out_dtype` (x's by default). The Triton kernel
differs only in the order of the K-sum (gemv_triton's 64-lane order).
"""

from __future__ import annotations

import torch

from kvloom.kernels.fp8_gemm import check_fp8_gemm_args
from kvloom.kernels.gemv import GEMV_MAX_M
from kvloom.kernels.paged_attention import compute_dtype
from kvloom.kernels.w4a16_gemm import w4a16_linear_ref

# Most rows the quantized linears send to the GEMV (more use the tensor-core GEMMs). All of
# GEMV_MAX_M: the GEMMs read the weight at a fraction of HBM bandwidth at decode sizes
# (0.12-0.15 ms for Qwen3-8B's 6144 x 4096 FP8 linear on an H200 against a 0.006 ms
# floor), so the GEMV should win up to 8 rows; benchmarks/quant_moe_plans.py --gemv
# measures both.
QUANT_GEMV_MAX_M = GEMV_MAX_M
LANES = 64  # columns per chunk of the kernel (gemv_triton.LANES)


def gemv_group(group_size: int, in_features: int, packed: bool) -> int | None:
    """The kernel's GROUP for a scale group: 0 when one group spans the row (a scale read
    once per row), the size when it is a multiple of 64 (one scale per 64-column chunk) or
    divides 64 (one per column; one per int32 word for int4, so 8 | size there); None
    when the GEMV cannot read it (the GEMM serves it)."""
    if group_size == in_features:
        return 0
    if group_size % LANES == 0 or (LANES % group_size == 0 and (not packed or group_size >= 8)):
        return group_size
    return None


def fp8_dequantize(w_q: torch.Tensor, w_s: torch.Tensor, group_size: int, dtype) -> torch.Tensor:
    """[N, K] e4m3 and [N, K / group] scales -> [N, K] in `dtype` (float32: one rounding)."""
    return w_q.to(dtype) * w_s.to(dtype).repeat_interleave(group_size, dim=1)


def fp8_gemv_ref(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N]: x times the dequantized FP8 weight (weight-only)."""
    n, k = check_fp8_gemm_args(x, w_q, w_s, group_size)
    acc = compute_dtype(x.dtype)
    y = x.reshape(-1, k).to(acc) @ fp8_dequantize(w_q, w_s, group_size, acc).t()
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(out_dtype or x.dtype).view(*x.shape[:-1], n)


def w4a16_gemv_ref(x, packed, scale, group_size, bias=None, out_dtype=None) -> torch.Tensor:
    """x [..., K] -> [..., N]: the W4A16 GEMM's own semantics (w4a16_linear_ref)."""
    return w4a16_linear_ref(x, packed, scale, group_size, bias, out_dtype)
