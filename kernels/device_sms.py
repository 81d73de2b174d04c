"""The streaming multiprocessor count that launch plans size their grids by."""

from __future__ import annotations

import functools

import torch

# The interpreter has no SMs: a small count keeps the plans' multi-program paths tested.
INTERPRETED_SMS = 8


def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device, INTERPRETED_SMS elsewhere (Triton's CPU interpreter)."""
    if device.type != "cuda":
        return INTERPRETED_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
