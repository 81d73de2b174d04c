"""Exact merge of attention outputs over disjoint key sets by log-sum-exp (reference)."""

from __future__ import annotations

import torch


def merge_attention_states_ref(
    outputs: torch.Tensor, lses: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """outputs: [P, T, H, D] partial results; lses: [P, T, H] natural-log sums.

    A part with lse = -inf (no keys) contributes nothing; a row with no keys anywhere
    gets output 0 and lse -inf.
    """
    total = torch.logsumexp(lses, dim=0)  # [T, H]
    safe_total = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    weights = torch.exp(lses - safe_total[None])  # exp(-inf) = 0 for empty parts
    acc = torch.float64 if outputs.dtype == torch.float64 else torch.float32
    merged = (outputs.to(acc) * weights[..., None].to(acc)).sum(0)
    return merged.to(outputs.dtype), total
