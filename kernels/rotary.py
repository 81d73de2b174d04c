"""Rotary position embedding applied in place of a copy: the pure-torch reference."""

from __future__ import annotations

import torch


def apply_rotary_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None = None
) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, rotary_dim // 2] for each token's position.

    Neox layout (Llama/Qwen in Hugging Face): the rotated dims are split in two halves.
    Only the first `rotary_dim` dims rotate (partial rotary); the rest pass through.
    """
    rotary_dim = rotary_dim or x.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((rotated, rest), dim=-1) if rest.numel() else rotated
