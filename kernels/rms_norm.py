"""RMSNorm, optionally fused with the residual add: the pure-torch reference."""

from __future__ import annotations

import torch

from kvloom.kernels.paged_attention import compute_dtype


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (norm(x + residual) * (weight_offset + weight), x + residual).

    `weight_offset=1` gives the (1 + w) scaling of Gemma / Qwen3-Next norms. Like Hugging
    Face, normalisation runs in float32 (float64 stays float64) and the weight multiplies
    after casting back to the input dtype.
    """
    if residual is not None:
        x = x + residual
        residual = x
    acc = compute_dtype(x.dtype)
    h = x.to(acc)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight_offset:
        out = (h * (weight_offset + weight.to(acc))).to(x.dtype)
    else:
        out = weight * h.to(x.dtype)
    return out, residual
