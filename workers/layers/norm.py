"""RMSNorm module over the kernel (fused residual add when a residual is passed)."""

from __future__ import annotations

import torch
from torch import nn

from kvloom.kernels.ops import rms_norm, rms_norm_widened
from kvloom.workers.layers.linear import check_shape


class RMSNorm(nn.Module):
    def __init__(
        self, size: int, eps: float = 1e-6, dtype=torch.float32, weight_offset: float = 0.0
    ):
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), False)

    def load_shard(self, param_name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        check_shape(param_name, loaded, tuple(self.weight.shape))
        self.weight.data.copy_(loaded)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out, new_residual = rms_norm(x, self.weight, self.eps, residual, self.weight_offset)
        return out if residual is None else (out, new_residual)

    def forward_widened(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """(normed, residual out, normed widened to float32), the last for a float32
        reader: stored by the norm's own launch on CUDA."""
        return rms_norm_widened(x, self.weight, self.eps, residual, self.weight_offset)
