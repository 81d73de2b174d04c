"""Every held request's block ids per KV-cache group, one int32 row per request slot.

A step's padded block table (rows in batch order, zero-padded: block 0 is the null block)
is then one gather of its rows, where rebuilding it from the requests' Python lists cost
about 4 ms at 880 rows of ~50 blocks on a CPU (`workers/batch_arrays.padded_block_table`,
which stays for requests placed without a slot). Rows only grow while a request is held
(the scheduler sends new block ids, never replacements), and a reused slot is rewritten
whole, so the entries past a row's length are always 0.
"""

from __future__ import annotations

import numpy as np


class BlockTable:
    def __init__(self) -> None:
        self.ids = np.zeros((0, 0), dtype=np.int32)
        self.lengths = np.zeros(0, dtype=np.int64)

    def _fit(self, slot: int, width: int) -> None:
        rows, cols = self.ids.shape
        if slot < rows and width <= cols:
            return
        new_rows = max(rows, 16)
        while new_rows <= slot:
            new_rows *= 2
        new_cols = max(cols, 16)
        while new_cols < width:
            new_cols *= 2
        ids = np.zeros((new_rows, new_cols), dtype=np.int32)
        ids[:rows, :cols] = self.ids
        lengths = np.zeros(new_rows, dtype=np.int64)
        lengths[:rows] = self.lengths
        self.ids, self.lengths = ids, lengths

    def set_row(self, slot: int, block_ids: list[int]) -> None:
        n = len(block_ids)
        self._fit(slot, n)
        self.ids[slot, :n] = block_ids
        self.ids[slot, n : max(n, int(self.lengths[slot]))] = 0
        self.lengths[slot] = n

    def extend_row(self, slot: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.lengths[slot])
        end = start + len(block_ids)
        self._fit(slot, end)
        self.ids[slot, start:end] = block_ids
        self.lengths[slot] = end

    def clear_row(self, slot: int) -> None:
        self.ids[slot, : int(self.lengths[slot])] = 0
        self.lengths[slot] = 0

    def gather(self, slots: np.ndarray) -> np.ndarray:
        """The rows of `slots`, in that order, zero-padded to the longest (int32)."""
        width = int(self.lengths[slots].max()) if len(slots) else 0
        return self.ids[slots, :width]
