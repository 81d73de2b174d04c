"""The worker's persistent view of running requests, updated by each SchedulerOutput diff."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvloom.contracts.sampling_params import SamplingParams
from kvloom.contracts.scheduler_output import SchedulerOutput
from kvloom.workers.batch_arrays import padded_block_table
from kvloom.workers.block_table import BlockTable


@dataclass
class CachedRequestState:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    sampling_seed: int
    block_ids: list[list[int]]  # per KV-cache group
    num_computed_tokens: int
    # Its row in the batch's BlockTables (None: placed directly, not by `apply`).
    slot: int | None = None

    def __post_init__(self) -> None:
        p = self.sampling_params
        # Sampled by the fused greedy argmax alone (no logprobs, penalties or min_tokens):
        # the sampler needs no per-row state for it, and steps of only such rows skip it.
        self.plain_greedy = (
            p.greedy and p.logprobs is None and not p.reads_token_history and not p.min_tokens
        )

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


class InputBatch:
    """Requests placed by `apply` also get a slot in per-group `BlockTable`s, so a step's
    padded block tables are gathers (`padded_tables`). A state put into `requests`
    directly (the memory profile's dummy rows, tests) has no slot; a step with such a row
    pads the requests' lists instead."""

    def __init__(self) -> None:
        self.requests: dict[str, CachedRequestState] = {}
        self.slot_of: dict[str, int] = {}
        self._free_slots: list[int] = []
        self.tables: list[BlockTable] = []

    def apply(self, sched: SchedulerOutput) -> None:
        for request_id in sched.finished_request_ids:
            self.requests.pop(request_id, None)
            self._release(request_id)
        for new in sched.new_requests:
            self.requests[new.request_id] = CachedRequestState(
                request_id=new.request_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=len(new.token_ids) - new.num_output_tokens,
                sampling_params=new.sampling_params,
                sampling_seed=new.sampling_seed,
                block_ids=[list(ids) for ids in new.block_ids],
                num_computed_tokens=new.num_computed_tokens,
            )
            self._place(self.requests[new.request_id])
        for cached in sched.cached_requests:
            state = self.requests[cached.request_id]
            state.token_ids.extend(cached.new_token_ids)
            for g, (ids, new_ids) in enumerate(zip(state.block_ids, cached.new_block_ids)):
                if new_ids:  # most decode steps bring no new block
                    ids.extend(new_ids)
                    if state.slot is not None:
                        self.tables[g].extend_row(state.slot, new_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _place(self, state: CachedRequestState) -> None:
        self._release(state.request_id)  # a re-sent request (after preemption) starts over
        while len(self.tables) < len(state.block_ids):
            self.tables.append(BlockTable())
        slot = self._free_slots.pop() if self._free_slots else len(self.slot_of)
        self.slot_of[state.request_id] = state.slot = slot
        for table, ids in zip(self.tables, state.block_ids):
            table.set_row(slot, ids)

    def _release(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            for table in self.tables:
                table.clear_row(slot)
            self._free_slots.append(slot)

    def padded_tables(self, request_ids: list[str], num_groups: int) -> list[np.ndarray]:
        """Per group, the requests' block ids in this order, zero-padded (int32)."""
        states = [self.requests[rid] for rid in request_ids]
        slots = [state.slot for state in states]
        if None in slots or len(self.tables) < num_groups:
            return [
                padded_block_table([state.block_ids[g] for state in states])
                for g in range(num_groups)
            ]
        index = np.array(slots, dtype=np.int64)
        return [self.tables[g].gather(index) for g in range(num_groups)]
