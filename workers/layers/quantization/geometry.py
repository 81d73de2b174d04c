"""Which slice of each checkpoint tensor a quantizable layer keeps on this rank."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Geometry:
    """A layer's weight as the checkpoint stores it and as this rank keeps it.

    parts: full output rows of each checkpoint tensor fused into the layer (q/k/v,
    gate/up; one part otherwise); part_ranges: the rows of each part this rank keeps;
    in_full / in_range: input columns in the checkpoint and on this rank;
    num_experts: stacked expert weights ([E, rows, cols]; checkpoint shard e * len(parts)
    + p is expert e's part p), or None for a plain linear."""

    parts: tuple[int, ...]
    part_ranges: tuple[tuple[int, int], ...]
    in_full: int
    in_range: tuple[int, int]
    num_experts: int | None = None

    @property
    def local_rows(self) -> int:
        return sum(end - start for start, end in self.part_ranges)

    @property
    def local_in(self) -> int:
        return self.in_range[1] - self.in_range[0]

    def part_offset(self, part: int) -> int:
        return sum(end - start for start, end in self.part_ranges[:part])

    @property
    def shards(self) -> int:
        return len(self.parts) * (self.num_experts or 1)

    def split_shard(self, shard: int) -> tuple[int | None, int]:
        """(expert or None, part) of a checkpoint shard index."""
        if self.num_experts is None:
            return None, shard
        return divmod(shard, len(self.parts))

    def lead(self) -> tuple[int, ...]:
        return () if self.num_experts is None else (self.num_experts,)
