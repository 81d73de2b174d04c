"""A request's state as the scheduler tracks it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvloom.contracts.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the engine failed under it (a worker died)

    def __init__(self, value: str) -> None:
        # A plain attribute, not a property: it is read for every request every step.
        self.finished = value in ("stop", "length", "abort", "error")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens sampled by a step still in flight (the engine scheduled the next step ahead):
    # they count towards the request's length for scheduling, not in its token ids yet.
    num_pending_output_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit on first schedule; -1 until known
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    num_preemptions: int = 0
    # Speculative decoding: drafts to verify in the next step (never part of the tokens
    # until accepted), and whether the linear state must return to its pre-draft backup.
    spec_token_ids: list[int] = field(default_factory=list)
    restore_state: bool = False
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0
    # When the scheduler received the first and the latest output token (time.monotonic):
    # time to first token and time per output token in `RequestOutput.metrics`.
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def extra_hash_key(self) -> bytes:
        return self.cache_salt.encode() if self.cache_salt else b""

    def append_output_token(self, token_id: int, now: float | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.last_token_time = time.monotonic() if now is None else now
        if self.first_token_time is None:
            self.first_token_time = self.last_token_time

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
