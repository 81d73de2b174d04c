"""The tensor-parallel group as layers see it: rank, size and two collectives.

Layers take the group as a constructor argument (never a global). `LocalGroup` is the
one-rank group of the in-process executor; the distributed executor passes a group backed
by torch.distributed with the same methods.
"""

from __future__ import annotations

from typing import Protocol

import torch


class TPGroup(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor: ...


class LocalGroup:
    rank = 0
    world_size = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return tensor


def shard_range(total: int, rank: int, world_size: int, what: str) -> tuple[int, int]:
    if total % world_size:
        raise ValueError(
            f"{what} ({total}) must be divisible by tensor_parallel_size ({world_size})"
        )
    size = total // world_size
    return rank * size, (rank + 1) * size


class CoordinatorTPGroup:
    """Adapts a torch.distributed `GroupCoordinator` to what layers expect: `rank` is the
    rank inside the tensor-parallel group (it picks this rank's shard)."""

    def __init__(self, coordinator):
        self.coordinator = coordinator
        self.rank = coordinator.rank_in_group
        self.world_size = coordinator.world_size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.coordinator.all_reduce(tensor)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return self.coordinator.all_gather(tensor, dim=dim)
