"""What the engine emits and what its users get.

Two layers, as vLLM's engine core and output processor:

- `EngineCoreOutput`: one request's step, as the engine core (scheduler + workers) emits it:
  only the new token ids and their raw logprobs, the finish reason and the cached-token count.
  It crosses the Ray step channel as is (a msgspec struct), so a long stream costs what it
  adds, never its whole history.
- The output processor (cluster/output_processor.py) turns those into `OutputDelta`s (text
  detokenized, stop strings matched, logprobs as Logprob dicts) for the front doors, or into
  cumulative `RequestOutput`s (vLLM's shape) for `Engine.step` and `LLM.generate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated position: token id -> Logprob (the sampled token and the top-N).
SampleLogprobs = list[dict[int, Logprob]]

# The workers' logprobs of one sampled token: (its logprob, its rank, [(token id, logprob)
# of the top-N, best first]) (contracts/runner_output.py).
RawLogprobs = tuple[float, int, list[tuple[int, float]]]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step did to one request (core side; no text)."""

    request_id: str
    new_token_ids: list[int]
    # One entry per new token, when the request asked for logprobs.
    new_logprobs: list[RawLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None while running
    stop_reason: int | str | None = None  # a stop token id, or the error's message
    # The last new token is the EOS or a stop token: it is not part of the text.
    ended_by_stop_token: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, Any] | None = None  # at finish: ttft_s, tpot_s, spec_* (engine_core)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class OutputDelta:
    """What is new in one request's output since its previous delta (front-door side).

    Text that may be the start of a stop string is held back until the next token shows
    whether it is one; a finished delta carries everything still held back (invariant 8).
    The counts are the totals so far (the usage once finished)."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # One dict per token id (token id -> Logprob) when logprobs were asked for.
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # set once finished
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cumulative_logprob: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.text or self.token_ids)

    def merged(self, later: OutputDelta) -> OutputDelta:
        """This delta followed by `later` (a stream backlog collapsed: nothing is lost)."""
        return OutputDelta(
            request_id=self.request_id,
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            logprobs=self.logprobs + later.logprobs,
            finished=later.finished,
            finish_reason=later.finish_reason,
            stop_reason=later.stop_reason,
            prompt_tokens=later.prompt_tokens,
            completion_tokens=later.completion_tokens,
            cached_tokens=later.cached_tokens,
            cumulative_logprob=later.cumulative_logprob,
            metrics=later.metrics,
        )


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the matched stop string or stop token id

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
