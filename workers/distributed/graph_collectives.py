"""Collectives inside captured CUDA graphs (TP > 1, DCP > 1; KVLOOM_MULTI_RANK_CUDA_GRAPHS).

NCCL collectives issued by torch.distributed can be recorded into a CUDA graph, on two
conditions that this module and `GroupCoordinator` take care of:
- the communicator exists before capture: NCCL creates it lazily at a group's first
  collective, and creating it inside a capture fails. `warm_up_for_capture` runs one
  all-reduce and one all-gather on every multi-rank group the forward uses, on the
  current stream, before the first capture (the capture's warm-up forwards then find
  them ready);
- the collective's buffers are fixed: `GroupCoordinator.all_gather` on CUDA gathers into
  one preallocated output (`all_gather_into_tensor`), not a Python list of pieces, so
  the graph records a single launch over addresses that replay reuses.

Sizes inside a graph are those of the captured shape. DCP's attention gather is equal-sized
by construction (every DCP rank holds all of the step's queries; only the KV is sharded),
so a captured gather carries no padding into results (invariant 9); an all-gather-v with
sizes that vary by step exchanges them on the host and is never captured.
"""

from __future__ import annotations

import torch


def _coordinator(group):
    """The GroupCoordinator behind a layer-facing TP group (or the group itself)."""
    return getattr(group, "coordinator", group)


def warm_up_for_capture(*groups) -> None:
    """One all-reduce and one all-gather on each multi-rank group, so every communicator
    is created before a graph is captured. Single-rank groups and None are skipped."""
    for group in groups:
        if group is None or group.world_size <= 1:
            continue
        coordinator = _coordinator(group)
        probe = torch.zeros(1, device=coordinator.device)
        coordinator.all_reduce(probe)
        coordinator.all_gather(probe, dim=0)
        if probe.is_cuda:
            torch.cuda.synchronize(probe.device)
