"""What the scheduler sends the workers each step: plain data, cheap to serialize.

New (or resumed) requests travel in full once; running requests travel as diffs (new
token ids the workers have not seen, new block ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvloom.contracts.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    request_id: str
    token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # per KV-cache group
    num_computed_tokens: int
    num_output_tokens: int  # outputs already in token_ids (a resumed request)
    sampling_seed: int


@dataclass(slots=True)
class CachedRequestData:
    request_id: str
    new_token_ids: list[int]
    new_block_ids: tuple[list[int], ...]
    num_computed_tokens: int


# A draft slot reserved for drafts the worker proposes itself (async scheduling).
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # request id -> tokens to compute this step (in batch order: dict order)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests the workers must forget (finished, aborted or preempted).
    finished_request_ids: list[str] = field(default_factory=list)
    # Sanitizer: blocks to NaN-fill before this step runs.
    blocks_to_poison: list[int] = field(default_factory=list)
    # Linear-state page copies (src, dst): before the forward (prefix hit -> live page)
    # and after it (live page -> checkpoint). Applied after the poisoning.
    state_copies_before: list[tuple[int, int]] = field(default_factory=list)
    state_copies_after: list[tuple[int, int]] = field(default_factory=list)
    # request id -> draft tokens verified after its real tokens this step (counted in
    # num_scheduled_tokens). PLACEHOLDER_TOKEN_ID entries (a step scheduled before the
    # previous one's drafts were back) are filled by the worker from its own proposals.
    scheduled_spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Structured outputs: request id -> the token bitmask its token sampled this step must
    # fall in (xgrammar's layout: int32 words, bit j of word i allows token 32 * i + j, as
    # little-endian bytes). Only requests with a grammar that sample this step appear. A
    # request verifying drafts has one mask per lane (the next token's, then one after each
    # draft), concatenated.
    grammar_bitmasks: dict[str, bytes] = field(default_factory=dict)
    # Async scheduling: grammar rows scheduled while their previous token is in flight.
    # Their masks are not here: a `GrammarBitmasks` for this `step_id` follows once that
    # token is read back and the matchers advanced, and the workers sample this step only
    # then (rows missing from it, requests that ended meanwhile, sample unmasked and are
    # discarded by the scheduler).
    grammar_bitmasks_follow: list[str] = field(default_factory=list)
    step_id: int = 0

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


GRAMMAR_BITMASKS_VERSION = 1


@dataclass
class GrammarBitmasks:
    """The masks a step scheduled ahead waits for (`SchedulerOutput.grammar_bitmasks_follow`):
    request id -> its bitmask in `grammar_bitmasks`' layout, for step `step_id`."""

    step_id: int
    bitmasks: dict[str, bytes] = field(default_factory=dict)
    version: int = GRAMMAR_BITMASKS_VERSION
