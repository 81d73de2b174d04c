"""Cumulative RequestOutputs -> deltas, holding back text that may start a stop string.

The engine reports each request's whole text, token ids and logprobs so far, and cuts the
text at a stop string once one is complete. A stream must therefore not send the first
characters of a stop string before it knows whether the rest follows: text is sent only up
to `StopStringMatcher.safe_length`, and everything held back goes out with the finished
output, which (finish or abort) carries the final text (invariant 8).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvloom.cluster.outputs import Logprob, RequestOutput
from kvloom.cluster.stop_strings import StopStringMatcher

logger = logging.getLogger(__name__)


@dataclass
class OutputDelta:
    """What is new since the previous delta of the same request."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # One dict per token id (token id -> Logprob) when logprobs were asked for.
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finished: bool = False
    # Set once the request has finished.
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not (self.text or self.token_ids)


class OutputDeltaTracker:
    """Per request: remembers what was sent, returns what is new."""

    def __init__(self, stop: list[str] | None = None) -> None:
        self._stops = StopStringMatcher(stop) if stop else None
        self._sent_text = ""
        self._num_tokens = 0
        self._num_logprobs = 0

    @property
    def sent_text(self) -> str:
        return self._sent_text

    def update(self, out: RequestOutput) -> OutputDelta:
        completion = out.outputs[0]
        text = completion.text
        if not text.startswith(self._sent_text):
            # The engine only appends, or cuts at a stop string we held back; anything else
            # would be an engine bug. Send what is new rather than drop or repeat text.
            logger.error("request %s: output text does not extend what was sent", out.request_id)
            common = 0
            while common < min(len(text), len(self._sent_text)) and (
                text[common] == self._sent_text[common]
            ):
                common += 1
            self._sent_text = self._sent_text[:common]
        if out.finished or self._stops is None:
            limit = len(text)
        else:
            limit = max(self._stops.safe_length(text), len(self._sent_text))
        delta = OutputDelta(text=text[len(self._sent_text) : limit], finished=out.finished)
        self._sent_text = text[:limit]
        delta.token_ids = list(completion.token_ids[self._num_tokens :])
        self._num_tokens = len(completion.token_ids)
        if completion.logprobs is not None:
            delta.logprobs = list(completion.logprobs[self._num_logprobs :])
            self._num_logprobs = len(completion.logprobs)
        if out.finished:
            delta.finish_reason = completion.finish_reason
            delta.stop_reason = completion.stop_reason
            delta.prompt_tokens = len(out.prompt_token_ids)
            delta.completion_tokens = len(completion.token_ids)
            delta.cached_tokens = out.num_cached_tokens
        return delta
