"""NaN-safe greedy token choice: the pure-torch reference.

Per row of logits [R, V], compared in float32 (exact for the half dtypes; float64 is
rounded to float32 first, as the sampler does with `logits.float()`):
1. NaN entries never win (they count as -inf).
2. A row with any +inf picks its FIRST +inf.
3. A row with nothing but -inf and NaN picks token 0.
4. Otherwise the index of the maximum, the FIRST (smallest) index on ties.
This is what `workers.sampler.sanitize_logits` followed by `argmax(-1)` picks; the rules
are written out here one by one (not through sanitize_logits or torch's argmax tie rule)
so the reference is an independent oracle for the fused Triton kernel beside it.
"""

from __future__ import annotations

import torch


def check_greedy_logits(logits: torch.Tensor) -> None:
    """logits: a 2-D floating tensor [rows, vocab] with vocab >= 1."""
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits: expected a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"logits: expected shape [rows, vocab], got {tuple(logits.shape)}")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits: expected a floating dtype, got {logits.dtype}")
    if logits.shape[1] == 0:
        raise ValueError("logits: the vocab dim is empty, no token can be chosen")


def _first_index_where(mask: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest column where mask is True (the vocab size where none is)."""
    vocab = mask.shape[1]
    cols = torch.arange(vocab, device=mask.device).expand_as(mask)
    return torch.where(mask, cols, vocab).min(dim=1).values


def greedy_argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """Chosen token ids [rows] (int64, on the logits' device)."""
    check_greedy_logits(logits)
    if logits.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    x = logits.float()
    x = x.masked_fill(x.isnan(), float("-inf"))  # rule 1
    pos_inf = x == float("inf")
    first_pos_inf = _first_index_where(pos_inf)  # rule 2
    nothing = (x == float("-inf")).all(dim=1)  # rule 3
    row_max = x.max(dim=1, keepdim=True).values
    first_max = _first_index_where(x == row_max)  # rule 4
    zero = torch.zeros_like(first_max)
    return torch.where(pos_inf.any(dim=1), first_pos_inf, torch.where(nothing, zero, first_max))
