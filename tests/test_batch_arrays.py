"""workers/batch_arrays.py against the per-row loops it replaced, on random batches."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvloom.workers.batch_arrays import padded_block_table, slot_mapping, token_positions


def per_row_slots(block_ids, block_size, start, end, dcp_size, dcp_rank):
    if dcp_size == 1:
        return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]
    local = block_size // dcp_size
    return [
        block_ids[p // block_size] * local + (p // dcp_size) % local
        if p % dcp_size == dcp_rank
        else -1
        for p in range(start, end)
    ]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("dcp_size,dcp_rank", [(1, 0), (2, 1), (4, 2)])
def test_positions_and_slots_match_the_per_row_loop(seed, dcp_size, dcp_rank):
    rng = random.Random(seed)
    block_size = 16
    starts, ends, tables, want_pos, want_slots, want_qs = [], [], [], [], [], [0]
    for _ in range(rng.randint(1, 12)):
        start = rng.choice([0, rng.randint(0, 200)])
        end = start + rng.choice([0, 1, 1, rng.randint(1, 70)])  # zero-length padding rows too
        ids = [
            rng.randint(1, 999) for _ in range(-(-max(end, 1) // block_size) + rng.randint(0, 2))
        ]
        starts.append(start)
        ends.append(end)
        tables.append(ids)
        want_pos += range(start, end)
        want_slots += per_row_slots(ids, block_size, start, end, dcp_size, dcp_rank)
        want_qs.append(want_qs[-1] + end - start)
    query_start, positions, row_of_token = token_positions(np.array(starts), np.array(ends))
    table = padded_block_table(tables)
    assert query_start.tolist() == want_qs and positions.tolist() == want_pos
    slots = slot_mapping(table, block_size, positions, row_of_token, dcp_size, dcp_rank)
    assert slots.dtype == np.int64 and slots.tolist() == want_slots


def test_padded_block_table_pads_with_the_null_block():
    table = padded_block_table([[3, 4], [], [7, 8, 9]])
    assert table.dtype == np.int32
    assert table.tolist() == [[3, 4, 0], [0, 0, 0], [7, 8, 9]]
    assert padded_block_table([[], []]).shape == (2, 0)
    assert padded_block_table([]).shape == (0, 0)
