"""workers/block_table.py and InputBatch.padded_tables: the gathered tables equal padding
the requests' own block lists, through random admissions, growth, ends, slot reuse and
re-sent (preempted) requests; states placed directly fall back to the lists."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvloom.contracts.sampling_params import SamplingParams
from kvloom.contracts.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from kvloom.workers.batch_arrays import padded_block_table
from kvloom.workers.block_table import BlockTable
from kvloom.workers.input_batch import CachedRequestState, InputBatch

GROUPS = 2


def new_request(rid, rng):
    blocks = tuple([rng.randint(1, 5000) for _ in range(rng.randint(0, 40))] for _ in range(GROUPS))
    return NewRequestData(rid, [1, 2, 3], SamplingParams(), blocks, 0, 0, 0)


def expected(batch, rids):
    return [padded_block_table([batch.requests[r].block_ids[g] for r in rids]) for g in range(2)]


@pytest.mark.parametrize("seed", range(6))
def test_gathered_tables_equal_the_padded_lists(seed):
    rng = random.Random(seed)
    batch, held, counter = InputBatch(), [], 0
    for _ in range(60):
        sched = SchedulerOutput()
        for rid in rng.sample(held, k=min(len(held), rng.randint(0, 3))):
            held.remove(rid)
            sched.finished_request_ids.append(rid)
            if rng.random() < 0.3:  # preempted: forgotten and re-sent in one step
                sched.new_requests.append(new_request(rid, rng))
                held.append(rid)
        for _ in range(rng.randint(0, 4)):
            counter += 1
            sched.new_requests.append(new_request(f"r{counter}", rng))
            held.append(f"r{counter}")
        placed = {n.request_id for n in sched.new_requests}
        for rid in held:
            if rid not in placed and rng.random() < 0.5:
                grow = tuple([rng.randint(1, 5000)] * rng.randint(0, 70) for _ in range(GROUPS))
                sched.cached_requests.append(CachedRequestData(rid, [9], grow, 0))
        batch.apply(sched)
        assert set(batch.slot_of) == set(held)  # ended requests give their slots back
        assert len(set(batch.slot_of.values())) == len(held)
        order = rng.sample(held, k=len(held))
        got = batch.padded_tables(order, GROUPS)
        want = expected(batch, order)
        for g in range(GROUPS):
            assert got[g].dtype == np.int32 and np.array_equal(got[g], want[g])


def test_directly_placed_states_take_the_lists():
    batch = InputBatch()
    sched = SchedulerOutput(new_requests=[new_request("a", random.Random(1))])
    batch.apply(sched)
    batch.requests["probe"] = CachedRequestState(
        "probe", [1], 1, SamplingParams(), 0, [[7, 8, 9], [4]], 0
    )
    got = batch.padded_tables(["probe", "a"], GROUPS)
    want = expected(batch, ["probe", "a"])
    assert all(np.array_equal(x, y) for x, y in zip(got, want))


def test_a_reused_slot_holds_no_old_ids():
    table = BlockTable()
    table.set_row(0, list(range(1, 40)))
    table.clear_row(0)
    table.set_row(0, [5, 6])
    table.set_row(1, [])
    got = table.gather(np.array([1, 0]))
    assert got.tolist() == [[0, 0], [5, 6]]
    assert table.gather(np.array([1])).shape == (1, 0)
