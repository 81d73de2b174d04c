"""Gated RMSNorm per value head (Qwen3-Next's Gated DeltaNet output norm): the reference.

  out = (weight * rmsnorm(x)) * silu(gate)

with the rounding points of `GatedRMSNorm.forward` in workers/layers/gated_deltanet.py
(and transformers' Qwen3NextRMSNormGated): the norm in float32 (float64 for float64 x),
rounded to x's dtype; the weight product in torch's promoted dtype of (weight, x), so
rounded to x's dtype when the weight has it; times silu(gate) in float32; rounded once to
x's dtype.

x is [T, Hv, D], normalised over D. The gate comes as a 4D view [T, Hk, r, D] with
Hk * r = Hv (value head hv = group * r + j reads gate[t, group, j]): in the Gated DeltaNet
layer it is the z part of the in_proj_qkvz output, whose rows hold, per key-head group of
width gw = 2 Dk + 2 r Dv, [q (Dk), k (Dk), v (r Dv), z (r Dv)], so
`qkvz.view(T, Hk, gw)[..., 2 Dk + r Dv:].view(T, Hk, r, Dv)` is that view with no copy.
A gate of x's own shape [T, Hv, D] is also accepted (r = 1).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_gated_rms_norm_args(x, gate, weight, eps) -> tuple[int, int, int, int]:
    """Shapes and dtypes (no device reads). Returns (T, Hv, D, r)."""
    for name, value in (("x", x), ("gate", gate), ("weight", weight)):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
        if value.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}: expected a floating dtype, got {value.dtype}")
    if x.dim() != 3:
        raise ValueError(f"x: expected [T, Hv, D], got shape {list(x.shape)}")
    tokens, num_v_heads, dim = x.shape
    if gate.dim() == 3 and tuple(gate.shape) == tuple(x.shape):
        group = 1
    elif (
        gate.dim() == 4
        and gate.shape[0] == tokens
        and gate.shape[3] == dim
        and gate.shape[1] * gate.shape[2] == num_v_heads
    ):
        group = gate.shape[2]
    else:
        raise ValueError(
            f"gate: expected [{tokens}, Hk, r, {dim}] with Hk * r = {num_v_heads} "
            f"(or x's shape), got {list(gate.shape)}"
        )
    if tuple(weight.shape) != (dim,):
        raise ValueError(f"weight: expected shape [{dim}], got {list(weight.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps):
        raise ValueError(f"eps must be a finite number, got {eps!r}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    return tokens, num_v_heads, dim, group


def gated_rms_norm_ref(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x [T, Hv, D], gate [T, Hk, r, D] (or [T, Hv, D]), weight [D] -> [T, Hv, D] in x's
    dtype."""
    tokens, num_v_heads, dim, _ = check_gated_rms_norm_args(x, gate, weight, eps)
    gate = gate.reshape(tokens, num_v_heads, dim)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(acc)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(x.dtype)
    return (h * F.silu(gate.to(acc))).to(x.dtype)
