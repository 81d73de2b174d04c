"""Token-level arrays of a step, computed in numpy from per-row spans.

The runner's per-request loop records only each row's span [start, end) of positions and
its block ids; positions, query starts, write slots and the padded block tables are built
here in a few vectorized passes (at 512 decode rows the per-row Python version of this was
most of the host time that left the GPU idle between steps on an H200).
"""

from __future__ import annotations

from itertools import chain

import numpy as np


def padded_block_table(rows: list[list[int]]) -> np.ndarray:
    """Block ids per row, zero-padded to the longest row (int32 [rows, width])."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    width = int(lengths.max()) if len(rows) else 0
    table = np.zeros((len(rows), width), dtype=np.int32)
    if width:
        flat = np.fromiter(chain.from_iterable(rows), dtype=np.int32, count=int(lengths.sum()))
        table[np.arange(width) < lengths[:, None]] = flat
    return table


def token_positions(starts: np.ndarray, ends: np.ndarray):
    """Every scheduled token's position and row: (query_start [rows + 1], positions
    [tokens], row_of_token [tokens]), all int64, rows in batch order."""
    lengths = ends - starts
    query_start = np.zeros(len(starts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=query_start[1:])
    total = int(query_start[-1])
    row_of_token = np.repeat(np.arange(len(starts), dtype=np.int64), lengths)
    positions = np.arange(total, dtype=np.int64) + (starts - query_start[:-1])[row_of_token]
    return query_start, positions, row_of_token


def slot_mapping(
    table: np.ndarray,
    block_size: int,
    positions: np.ndarray,
    row_of_token: np.ndarray,
    dcp_size: int = 1,
    dcp_rank: int = 0,
) -> np.ndarray:
    """Cache slots of the tokens (int64). Under DCP a rank writes only positions
    p % dcp_size == dcp_rank, at local index p // dcp_size (others get -1)."""
    blocks = table[row_of_token, positions // block_size].astype(np.int64)
    if dcp_size == 1:
        return blocks * block_size + positions % block_size
    local = block_size // dcp_size
    slots = blocks * local + (positions // dcp_size) % local
    return np.where(positions % dcp_size == dcp_rank, slots, -1)
