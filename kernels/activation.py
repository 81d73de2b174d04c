"""Gated activations: the pure-torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim; returns silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gated_add_ref(base: torch.Tensor, gate_logit: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """base + sigmoid(gate_logit) * x, with gate_logit one scalar per row ([T, 1]), rounded
    to base's dtype after each operation as torch's three launches round (Qwen3-Next's
    shared expert, scaled by its gate, added to the routed experts' output)."""
    return base + torch.sigmoid(gate_logit) * x


def mul_sigmoid_ref(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) for x [T, N] and a gate of T * N elements per row in any strided
    layout (Qwen3-Next's per-head output gate, [T, H, D] read beside the query): gate is
    reshaped to x's shape (a copy when strided), sigmoid rounded to the dtype, then the
    product rounded, as torch's three launches do."""
    return x * torch.sigmoid(gate.reshape(x.shape))
