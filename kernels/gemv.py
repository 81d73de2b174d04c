"""Small-M linear layer y = x @ W^T (+ bias): the pure-torch reference of `gemv_triton`.

Rounding, exactly where it happens (the Triton kernel does the same):
1. every product and partial sum is float32 (float64 inputs stay float64);
2. the bias, if any, is added to the float32 sum, in float32;
3. the result is rounded once, to x's dtype.
Only the order of the K-sum differs between the two (see gemv_triton's module docstring),
so the kernel's result is within a few float32 ulps of this one before the final rounding.
"""

from __future__ import annotations

import torch

from kvloom.kernels.activation import silu_and_mul_ref
from kvloom.kernels.causal_conv1d import causal_conv1d_update
from kvloom.kernels.paged_attention import compute_dtype
from kvloom.kernels.rms_norm import rms_norm_ref

GEMV_MAX_M = 8  # most rows the Triton GEMV serves; more rows use cuBLAS (F.linear)
# Rows up to which the linear layers use it: on an H200 it beat cuBLAS by 1.04-1.31x at
# one and two rows on the Qwen3-8B and Qwen3-Next shapes, and lost at four (0.71-0.98x on
# all but the smallest shapes; benchmarks/gemv_plans.py, docs/benchmarks/gpu_fast_path.md).
GEMV_DISPATCH_MAX_M = 2
# Most rows of the GEMV with RMSNorm fused into its prologue (gemv_triton: rows unrolled
# by hand); the dispatch range above.
NORM_GEMV_MAX_M = 2
# Longest row (hidden size) it normalizes: each program sums the row's squares in
# K / 1024 unrolled steps; longer rows take the norm and the GEMV as two launches.
NORM_GEMV_MAX_K = 16384
# Most rows of the GEMV with a conv decode step in its epilogue (Gated DeltaNet's in_proj:
# rows unrolled by hand, as the norm's); the dispatch range above.
CONV_GEMV_MAX_M = 2


def gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K], weight [N, K] (nn.Linear layout), bias [N] or None -> [M, N] in x's dtype."""
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D [M, K] tensor, got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"weight: expected shape [N, {x.shape[1]}] (x's K), got {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias: expected shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    acc = compute_dtype(x.dtype)
    y = x.to(acc) @ weight.to(acc).t()
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


def gemv_silu_and_mul_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """silu(gate) * up for the merged [gate; up] weight [2I, K] (bias [2I]) -> [M, I]: the
    reference of gemv_triton.gemv_silu_and_mul_triton, with its roundings (gate and up
    each rounded to x's dtype, then silu_and_mul_ref's)."""
    if weight.dim() == 2 and weight.shape[0] % 2:
        raise ValueError(f"weight: expected [gate; up] rows (an even count), got {weight.shape[0]}")
    return silu_and_mul_ref(gemv_ref(x, weight, bias))


def rms_norm_gemv_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    weight_offset: float = 0.0,
    silu_and_mul: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The reference of gemv_triton.rms_norm_gemv_triton: the norm, then the GEMV (or
    GEMV + SiLU-and-mul) on its output. Returns (y, x + residual or None, normed)."""
    normed, new_residual = rms_norm_ref(x, norm_weight, eps, residual, weight_offset)
    project = gemv_silu_and_mul_ref if silu_and_mul else gemv_ref
    return project(normed, weight, bias), new_residual, normed


def rms_norm_gemv_conv_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_weight: torch.Tensor,
    conv_state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    weight_offset: float = 0.0,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The reference of gemv_triton.rms_norm_gemv_conv_triton: rms_norm_gemv_ref, then the
    conv decode step (causal_conv1d.causal_conv1d_update, the pool updated in place) on
    the first C = conv_weight.shape[0] columns of its output. Returns (y, x + residual or
    None, the conv output [M, C])."""
    y, new_residual, _ = rms_norm_gemv_ref(
        x, residual, norm_weight, eps, weight, bias, weight_offset=weight_offset
    )
    channels = conv_weight.shape[0]
    conv = causal_conv1d_update(
        y[:, :channels], conv_weight, None, conv_state_pool, state_indices, activation
    )
    return y, new_residual, conv
