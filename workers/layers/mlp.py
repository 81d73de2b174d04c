"""Gated MLP: down(act(gate(x)) * up(x)), gate and up fused in one column-parallel weight."""

from __future__ import annotations

import torch
from torch import nn

from kvloom.kernels.ops import linear_silu_and_mul, silu_and_mul
from kvloom.workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from kvloom.workers.layers.tp_group import TPGroup

SUPPORTED_ACTIVATIONS = ("silu",)


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str = "silu",
        bias: bool = False,
        tp: TPGroup | None = None,
        dtype: torch.dtype = torch.float32,
        reduce_results: bool = True,
    ):
        super().__init__()
        if hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"hidden_act must be one of {SUPPORTED_ACTIVATIONS}, got {hidden_act!r}"
            )
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, tp=tp, dtype=dtype
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias=bias,
            tp=tp,
            dtype=dtype,
            reduce_results=reduce_results,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if gate_up.quant_method is None and not gate_up.gather_output:
            # What gate_up(x) computes, with the activation fused into the decode GEMV.
            act = linear_silu_and_mul(x, gate_up.weight, gate_up.bias)
        else:
            act = silu_and_mul(gate_up(x))
        return self.down_proj(act)
