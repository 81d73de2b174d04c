"""fla's varlen chunk layout: which sequence each 64-token chunk of a packed step belongs to.

fla's chunked kernels (Gated DeltaNet, KDA) read, for every chunk, its sequence and its
place in that sequence, and for every sequence its first chunk. `KVLOOM_FLA_LAYOUT` says
who lays that out:

- `fla`: fla, from the host bounds, then a copy to the device from pageable memory, which
  waits for the stream (once a step: fla keeps the layout per bounds object);
- `device`: fla on the device in every layer, no wait (fla's use_graph form; KDA only,
  Gated DeltaNet takes `fla` there);
- `staged`: kvloom, on the host once a step (`chunk_layout`), copied through pinned memory
  with no wait (`staged_chunk_layout`) and handed to fla.
"""

from __future__ import annotations

import numpy as np
import torch

from kvloom.contracts import envs
from kvloom.kernels.device_copy import to_device_packed

FLA_CHUNK = 64  # the chunk of fla's Gated DeltaNet and KDA kernels (their default)
LAYOUTS = ("fla", "device", "staged")


def fla_layout() -> str:
    """KVLOOM_FLA_LAYOUT, checked."""
    choice = envs.get("KVLOOM_FLA_LAYOUT").strip().lower()
    if choice not in LAYOUTS:
        raise ValueError(f"KVLOOM_FLA_LAYOUT must be fla, device or staged, got {choice!r}")
    return choice


def chunk_layout(bounds: list[int], chunk: int = FLA_CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """The layout from sequence bounds [N+1]: indices [NT, 2] int64 (each chunk's sequence
    and its place in it, sequences in order; an empty sequence has none) and offsets [N+1]
    int64 (each sequence's first chunk; offsets[-1] = NT)."""
    lens = np.diff(np.asarray(bounds, dtype=np.int64))
    if (lens < 0).any():
        raise ValueError(f"cu_seqlens: bounds must not decrease, got {list(bounds)}")
    chunks = -(-lens // chunk)
    offsets = np.concatenate([np.zeros(1, np.int64), np.cumsum(chunks)])
    sequence = np.repeat(np.arange(len(lens), dtype=np.int64), chunks)
    within = np.arange(offsets[-1], dtype=np.int64) - offsets[sequence]
    return np.stack([sequence, within], axis=1), offsets


# The last staged layout, keyed by the device bounds object it was made for and the bounds'
# values (a bounds buffer refilled in place must not hit): every layer of a step passes
# the same object (`cu_seqlens_device`), so a step copies its layout once.
_last_staged: list = []


def staged_chunk_layout(bounds: list[int], cu_dev: torch.Tensor):
    """(indices [NT, 2], offsets [N+1]) of `chunk_layout(bounds)` on cu_dev's device, in
    one staged copy that does not wait for the stream (kernels/device_copy.py)."""
    bounds = list(bounds)
    if _last_staged and _last_staged[0][0] is cu_dev and _last_staged[0][1] == bounds:
        return _last_staged[0][2]
    layout = tuple(to_device_packed(list(chunk_layout(bounds)), torch.int64, cu_dev.device))
    _last_staged[:] = [(cu_dev, bounds, layout)]
    return layout
