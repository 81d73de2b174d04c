"""Per-step batch description shared by every layer of the forward pass.

`ForwardBatch` is built once per step by the model runner and passed explicitly down
the model (no global context). It holds, per KV-cache group, the block table and slot
mapping, and for the whole batch the row layout and the one row classification
(invariant 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvloom.workers.linear_rows import LinearRows, build_linear_rows
from kvloom.workers.row_kinds import RowClasses


@dataclass
class GroupMetadata:
    """Where one KV-cache group's tokens live: block table rows and write slots."""

    block_tables: torch.Tensor  # [num_rows, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not write
    # Linear-state groups: the block holding each row's live state (-1 for padding rows).
    state_indices: torch.Tensor | None = None


@dataclass
class ForwardBatch:
    positions: torch.Tensor  # [num_tokens]
    query_start_loc: torch.Tensor  # [num_rows + 1] int32
    seq_lens: torch.Tensor  # [num_rows] context length after this step's tokens
    num_computed_tokens: torch.Tensor  # [num_rows] before this step
    query_start_loc_list: list[int]
    seq_lens_list: list[int]
    rows: RowClasses
    groups: list[GroupMetadata] = field(default_factory=list)
    # layer index -> KV-cache group index, fixed at model construction.
    layer_to_group: dict[int, int] = field(default_factory=dict)
    # Every row is a true decode of one token (invariant 1) and token i belongs to row i;
    # rows past the real ones may be padding (seq_len 0, no write slot, state index -1).
    # Layers then take their host-sync-free decode path (the one CUDA graphs capture).
    decode_only: bool = False

    @property
    def num_rows(self) -> int:
        return len(self.seq_lens_list)

    def group_for(self, layer_index: int) -> GroupMetadata:
        return self.groups[self.layer_to_group[layer_index]]

    def linear_rows(self, device) -> LinearRows:
        """The row split of linear-state layers, built on first use and shared by every
        layer of the step."""
        cache = self.__dict__.setdefault("_linear_rows", {})
        key = str(device)
        if key not in cache:
            cache[key] = build_linear_rows(self.rows, self.query_start_loc_list, device)
        return cache[key]
