"""KDA's output norm (Kimi-Linear's KimiLinearRMSNormGated): the reference.

  out = weight * rmsnorm(x) * sigmoid(gate)

per head, all in float32 (float64 for float64 x), rounded once to x's dtype: the rounding
points of transformers' module. Unlike Gated DeltaNet's norm (kernels/gated_rms_norm.py)
the gate goes through a sigmoid, not a SiLU, and neither the normed row nor the weight
product is rounded to x's dtype.

x and gate are [T, H, D] (any strides with the last dim contiguous), weight [D].
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_kda_gated_norm_args(x, gate, weight, eps) -> tuple[int, int, int]:
    """Shapes and dtypes (no device reads). Returns (T, H, D)."""
    for name, value in (("x", x), ("gate", gate), ("weight", weight)):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
        if value.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}: expected a floating dtype, got {value.dtype}")
    if x.dim() != 3:
        raise ValueError(f"x: expected [T, H, D], got shape {list(x.shape)}")
    if tuple(gate.shape) != tuple(x.shape):
        raise ValueError(f"gate: expected x's shape {list(x.shape)}, got {list(gate.shape)}")
    if tuple(weight.shape) != (x.shape[2],):
        raise ValueError(f"weight: expected shape [{x.shape[2]}], got {list(weight.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps):
        raise ValueError(f"eps must be a finite number, got {eps!r}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    return tuple(x.shape)


def kda_gated_norm_ref(x, gate, weight, eps):
    """The torch composition (about 12 launches on CUDA at half precision)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(acc)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight.to(acc) * h * torch.sigmoid(gate.to(acc))
    return h.to(x.dtype)
