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


# Triton compiles a kernel apart for each pointer argument that is (or is not) a multiple
# of 16 bytes: views packed at arbitrary offsets would make a step's inputs flip between
# those variants, and each new one costs a compile on the host mid-run.
PACK_ALIGN_BYTES = 16


def to_device_packed(arrays: list[np.ndarray], dtype: torch.dtype, device: torch.device):
    """Several host arrays of one dtype in one staged copy: one pinned buffer and one
    transfer instead of one of each per array (each costs tens of microseconds of host
    time). Returns device tensors of the arrays' shapes, views of one allocation, each
    starting PACK_ALIGN_BYTES-aligned (as a fresh allocation would)."""
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    align = max(1, PACK_ALIGN_BYTES // np_dtype.itemsize)
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.size // align) * align
    flat = np.zeros(total, dtype=np_dtype)
    for a, start in zip(arrays, offsets):
        flat[start : start + a.size] = a.reshape(-1)
    packed = to_device(torch.from_numpy(flat), dtype, device)
    return [packed[start : start + a.size].view(a.shape) for a, start in zip(arrays, offsets)]
