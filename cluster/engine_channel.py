"""The messages between the front door and a scheduler actor, and their delta encoding.

Requests go in and outputs come out over two one-way zmq channels set up once through Ray
(the step channel's `ResultChannel`/`ResultSender` pair, one each way), never as a Ray call
per request or a poll per step:

    RemoteEngine ── Commands (adds, aborts, stats asks) ──► SchedulerActor
                 ◄── Events (output deltas, rejections, stats, failure) ──

An output crosses as a delta against what was sent for that request before (new token ids,
new text, new logprobs), so a long stream costs what it adds, not its whole history each
step. `OutputEncoder` (actor side) makes deltas; `OutputDecoder` (front door) rebuilds the
cumulative `RequestOutput`s the engine interface promises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvloom.cluster.outputs import CompletionOutput, Logprob, RequestOutput
from kvloom.contracts.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    # How long the request waited before it was sent (clocks differ between nodes).
    age_s: float = 0.0


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class AskStats(msgspec.Struct, tag="stats", array_like=True):
    ask_id: int


class Commands(msgspec.Struct, array_like=True):
    items: list[AddRequest | AbortRequests | AskStats]


class OutputDelta(msgspec.Struct, array_like=True):
    """What one step added to a request's output. `*_from` is where the new items start in
    the cumulative sequence (normally its old length; less only where text was revised)."""

    request_id: str
    tokens_from: int
    token_ids: list[int]
    text_from: int
    text: str
    logprobs_from: int
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    metrics: dict[str, Any]


class Rejection(msgspec.Struct, array_like=True):
    """A request the engine refused at admission: a bad one (`message` names the field),
    or any, once the engine is down (`engine_down`)."""

    request_id: str
    message: str
    engine_down: bool = False


class Events(msgspec.Struct, array_like=True):
    deltas: list[OutputDelta] = []
    rejections: list[Rejection] = []
    stats: dict[int, dict[str, Any]] = {}
    # Set once the engine failed (a worker died): it ends every request and takes no more.
    failure: str | None = None


@dataclass
class RequestError:
    """An error for one request that `RemoteEngine.step` hands back beside its outputs."""

    request_id: str
    message: str
    engine_down: bool = False  # not the request's fault: the engine had failed
    # Not the request's fault either: the data-parallel replica serving it failed, and the
    # others still serve (cluster/replicas.py). UNAVAILABLE, but not the server's failure.
    replica_lost: bool = False


def _common_prefix(a, b) -> int:
    """How much of `a` starts `b` (all of it, but for a revised text)."""
    if b.startswith(a):  # the usual case: no copies
        return len(a)
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class OutputEncoder:
    """Actor side: turns the engine's cumulative outputs into deltas."""

    def __init__(self) -> None:
        # request id -> (tokens sent, text sent, logprobs sent)
        self._sent: dict[str, tuple[int, str, int]] = {}

    def delta(self, out: RequestOutput) -> OutputDelta:
        completion = out.outputs[0]
        n_tokens, text, n_logprobs = self._sent.get(out.request_id, (0, "", 0))
        tokens_from = min(n_tokens, len(completion.token_ids))
        text_from = _common_prefix(text, completion.text)
        logprobs = completion.logprobs
        logprobs_from = min(n_logprobs, len(logprobs)) if logprobs is not None else 0
        if out.finished:
            self._sent.pop(out.request_id, None)
        else:
            self._sent[out.request_id] = (
                len(completion.token_ids),
                completion.text,
                len(logprobs) if logprobs is not None else 0,
            )
        return OutputDelta(
            request_id=out.request_id,
            tokens_from=tokens_from,
            token_ids=completion.token_ids[tokens_from:],
            text_from=text_from,
            text=completion.text[text_from:],
            logprobs_from=logprobs_from,
            logprobs=logprobs[logprobs_from:] if logprobs is not None else None,
            cumulative_logprob=completion.cumulative_logprob,
            finished=out.finished,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            num_cached_tokens=out.num_cached_tokens,
            metrics=out.metrics,
        )

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


class OutputDecoder:
    """Front-door side: rebuilds cumulative RequestOutputs from deltas."""

    def __init__(self) -> None:
        # request id -> (prompt token ids, token ids, text, logprobs or None)
        self._state: dict[str, tuple[list[int], list[int], str, list | None]] = {}

    def start(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self._state[request_id] = (prompt_token_ids, [], "", None)

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    def apply(self, delta: OutputDelta) -> RequestOutput | None:
        state = self._state.get(delta.request_id)
        if state is None:
            return None  # not ours any more (aborted here, or from an earlier engine)
        prompt_ids, token_ids, text, logprobs = state
        token_ids = token_ids[: delta.tokens_from] + delta.token_ids
        text = text[: delta.text_from] + delta.text
        if delta.logprobs is not None:
            logprobs = (logprobs or [])[: delta.logprobs_from] + delta.logprobs
        if delta.finished:
            del self._state[delta.request_id]
        else:
            self._state[delta.request_id] = (prompt_ids, token_ids, text, logprobs)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=delta.cumulative_logprob,
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
        )
        return RequestOutput(
            request_id=delta.request_id,
            prompt=None,
            prompt_token_ids=prompt_ids,
            outputs=[completion],
            finished=delta.finished,
            num_cached_tokens=delta.num_cached_tokens,
            metrics=delta.metrics,
        )
