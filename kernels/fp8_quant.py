"""FP8 (e4m3) activation quantization: the pure-torch reference.

Block-scaled FP8 checkpoints (DeepSeek-V3 / Qwen3 "fp8", `activation_scheme: dynamic`)
quantize activations at run time per token and per group of `group_size` consecutive
input features: scale = max(|x_group|, eps) / 448, x_q = clamp(x / scale) cast to e4m3
(round to nearest even), the format vLLM's `per_token_group_quant_fp8` produces.
Per-channel checkpoints (compressed-tensors float-quantized) use one group per token
(dynamic "token" strategy) or a static per-tensor `input_scale`.

The Triton kernels compute the same scale (an exact max and a correctly rounded
division), so their quantized activations are bitwise the reference's.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
SCALE_EPS = 1e-10  # floor of a group's max |x|: an all-zero group gets a tiny scale, not 0


def check_group_size(group_size, width: int, field: str = "group_size") -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{field} must be a positive int, got {group_size!r}")
    if width % group_size:
        raise ValueError(f"{field} ({group_size}) must divide the input width ({width})")


def quantize_fp8_with_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, clamped to the e4m3 range and rounded; `scale` broadcasts against x."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def per_token_group_quant_fp8_ref(
    x: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (x_q [T, K] float8_e4m3fn, scales [T, K // group_size] float32)."""
    if x.dim() != 2:
        raise ValueError(f"x: expected [T, K], got shape {list(x.shape)}")
    check_group_size(group_size, x.shape[1])
    groups = x.float().unflatten(1, (x.shape[1] // group_size, group_size))
    peak = groups.abs().amax(dim=-1).clamp_min(SCALE_EPS)
    # A tensor divisor, not the Python number: on CUDA torch divides by a CPU scalar as a
    # multiplication by its reciprocal, which rounds differently from a division; on an
    # H100 that moved 59% of the scales by an ulp and flipped e4m3 codes (2026-12-05).
    # Divided by a tensor, every device rounds amax / 448 correctly, as the kernels do.
    scales = peak / torch.full_like(peak, FP8_MAX)
    x_q = quantize_fp8_with_scale(groups, scales[..., None]).flatten(1)
    return x_q, scales


def per_token_quant_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (x_q [T, K] float8_e4m3fn, scales [T, 1] float32): one group per token."""
    x_q, scales = per_token_group_quant_fp8_ref(x, x.shape[1])
    return x_q, scales
