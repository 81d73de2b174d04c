"""Arrival counters: int32 zeros that a launch's programs count themselves in at, so the
last to arrive does a tail's work (the MoE slot sum, the router epilogue, the linear
attention's output norm) and resets its counter. Every launch leaves its counters at 0, so
one buffer serves every layer, step and CUDA-graph replay in stream order.

A launch of more rows than a buffer holds gets a bigger one; the old buffer is kept alive
(a captured CUDA graph may hold its pointer, which must never dangle)."""

import torch

_BUFFERS: dict[tuple[str, torch.device, int], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def arrival_counters(
    owner: str, device: torch.device, rows: int, cols: int, min_rows: int = 1
) -> torch.Tensor:
    """Zeroed int32 counters [>= rows, cols] for `owner`'s launches on `device` (at least
    `min_rows` rows, so the usual launches never need a new buffer)."""
    key = (owner, device, cols)
    counters = _BUFFERS.get(key)
    if counters is None or counters.shape[0] < rows:
        if counters is not None:
            _RETIRED.append(counters)
        size = max(rows, min_rows)
        counters = torch.zeros((size, cols), dtype=torch.int32, device=device)
        _BUFFERS[key] = counters
    return counters


def counters_of(owner: str) -> list[torch.Tensor]:
    """Every live buffer of `owner` (tests check that launches leave them at 0)."""
    return [c for (name, _, _), c in _BUFFERS.items() if name == owner]
