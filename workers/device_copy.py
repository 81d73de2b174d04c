"""Host lists to device tensors without waiting for the device.

`torch.tensor(values, device="cuda")` copies from pageable memory and then synchronises
the stream, so it waits for every launch queued before it. With async scheduling the
next step's inputs are built while the current step runs: staging them in pinned memory
and copying with `non_blocking=True` keeps the host from waiting (torch's pinned-memory
cache keeps each staging block alive until its copy has run).
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device=device, dtype=dtype)
    return host.to(dtype).pin_memory().to(device, non_blocking=True)


def to_device_packed(arrays: list[np.ndarray], dtype: torch.dtype, device: torch.device):
    """Several host arrays of one dtype in one staged copy: one pinned buffer and one
    transfer instead of one of each per array (each costs tens of microseconds of host
    time). Returns device tensors of the arrays' shapes, views of one allocation."""
    sizes = [a.size for a in arrays]
    flat = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0)
    packed = to_device(torch.from_numpy(flat), dtype, device)
    out, offset = [], 0
    for a, n in zip(arrays, sizes):
        out.append(packed[offset : offset + n].view(a.shape))
        offset += n
    return out
