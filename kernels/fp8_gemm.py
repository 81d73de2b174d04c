"""FP8 (e4m3) weight GEMM with FP8 activations: the pure-torch reference.

One kernel semantics serves both FP8 weight layouts kvloom reads:

* block-scaled checkpoints (`quant_method: fp8`, `weight_block_size` [bn, bk]): the loader
  expands the [ceil(N / bn), ceil(K / bk)] `weight_scale_inv` to one row per output row,
  so `w_s` is [N, K / bk] and the activation group is bk;
* per-channel / per-tensor checkpoints (compressed-tensors float-quantized): `w_s` is
  [N, 1] (a per-tensor scale repeated on every row of its part) and the group is K.

The weight is w_q * w_s (the block format names its scale `weight_scale_inv`: it is the
inverse of the quantizer's scale, so it multiplies). Activations are quantized per token
and group (`fp8_quant`), or with a static per-tensor `input_scale`. Each group's exact
partial dot (e4m3 products are exact in float32) is scaled by x_s * w_s and the groups are
summed in K order, in float32:

    out[t, n] = sum_g (x_q[t, g] . w_q[n, g]) * x_s[t, g] * w_s[n, g]

The Triton kernel (`fp8_gemm_triton`) differs only in float32 summation order. The result
is rounded once to the requested dtype (x's by default).
"""

from __future__ import annotations

import torch

from kvloom.kernels.fp8_quant import (
    FP8_DTYPE,
    check_group_size,
    per_token_group_quant_fp8_ref,
    quantize_fp8_with_scale,
)


def check_fp8_gemm_args(x, w_q, w_s, group_size) -> tuple[int, int]:
    """Shapes shared by the reference and the Triton path; returns (N, K)."""
    k = x.shape[-1]
    if w_q.dtype != FP8_DTYPE:
        raise ValueError(f"weight: expected {FP8_DTYPE}, got {w_q.dtype}")
    if w_q.dim() != 2 or w_q.shape[1] != k:
        raise ValueError(f"weight: expected [N, {k}], got shape {list(w_q.shape)}")
    check_group_size(group_size, k)
    want = (w_q.shape[0], k // group_size)
    if tuple(w_s.shape) != want or w_s.dtype != torch.float32:
        raise ValueError(
            f"weight scale: expected float32 {list(want)}, got {w_s.dtype} {list(w_s.shape)}"
        )
    return w_q.shape[0], k


def quantize_input_fp8(
    x: torch.Tensor, group_size: int, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (x_q, x_s [T, K / group_size]): dynamic per token group, or one static
    per-tensor scale (then the group must be K)."""
    if input_scale is None:
        return per_token_group_quant_fp8_ref(x, group_size)
    if group_size != x.shape[1]:
        raise ValueError("a static input_scale needs one activation group per token")
    scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    return quantize_fp8_with_scale(x, scale), scale.contiguous()


def fp8_matmul_ref(x_q, x_s, w_q, w_s, group_size: int) -> torch.Tensor:
    """float32 [T, N] from quantized activations and weights."""
    out = torch.zeros(x_q.shape[0], w_q.shape[0], dtype=torch.float32, device=x_q.device)
    for g, start in enumerate(range(0, w_q.shape[1], group_size)):
        stop = start + group_size
        part = x_q[:, start:stop].float() @ w_q[:, start:stop].float().T
        out += part * x_s[:, g, None] * w_s[None, :, g]
    return out


def fp8_linear_ref(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    group_size: int,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N] in `out_dtype` (default x's dtype)."""
    n, k = check_fp8_gemm_args(x, w_q, w_s, group_size)
    x_q, x_s = quantize_input_fp8(x.reshape(-1, k), group_size, input_scale)
    out = fp8_matmul_ref(x_q, x_s, w_q, w_s, group_size)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or x.dtype).view(*x.shape[:-1], n)
