"""Half-precision tensor parallelism rounds where one rank rounds.

A row-parallel layer's ranks each hold part of the contraction. Rounding each partial sum
to bf16 before the all-reduce (then rounding the sum again) differs from one GEMM's single
rounding in a visible fraction of outputs, and greedy tokens drift at near-ties. kvloom
keeps the partials in float32 through the reduction (`linear_float32_out`), so TP=2's
result is TP=1's up to float32 accumulation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvloom.workers.layers.linear import linear_float32_out


def test_float32_partials_reproduce_one_gemm():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=gen).to(torch.bfloat16)
    w = (torch.randn(256, 512, generator=gen) * 0.05).to(torch.bfloat16)
    whole = F.linear(x, w)
    halves = [slice(0, 256), slice(256, 512)]
    exact = sum(linear_float32_out(x[:, h], w[:, h]) for h in halves).to(torch.bfloat16)
    rounded_each = sum(F.linear(x[:, h], w[:, h]) for h in halves)
    same_exact = (exact == whole).float().mean().item()
    same_rounded = (rounded_each == whole).float().mean().item()
    assert linear_float32_out(x, w).dtype == torch.float32
    assert same_exact > 0.99, same_exact
    assert same_rounded < 0.9, same_rounded  # why the float32 reduction exists
