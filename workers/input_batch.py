"""The worker's persistent view of running requests, updated by each SchedulerOutput diff."""

from __future__ import annotations

from dataclasses import dataclass

from kvloom.contracts.sampling_params import SamplingParams
from kvloom.contracts.scheduler_output import SchedulerOutput


@dataclass
class CachedRequestState:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    sampling_seed: int
    block_ids: list[list[int]]  # per KV-cache group
    num_computed_tokens: int

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
    def __init__(self) -> None:
        self.requests: dict[str, CachedRequestState] = {}

    def apply(self, sched: SchedulerOutput) -> None:
        for request_id in sched.finished_request_ids:
            self.requests.pop(request_id, None)
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
        for cached in sched.cached_requests:
            state = self.requests[cached.request_id]
            state.token_ids.extend(cached.new_token_ids)
            for ids, new_ids in zip(state.block_ids, cached.new_block_ids):
                ids.extend(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens
