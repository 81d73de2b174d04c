"""The messages between the front door and a scheduler actor.

Requests go in and outputs come out over two one-way zmq channels set up once through Ray
(the step channel's `ResultChannel`/`ResultSender` pair, one each way), never as a Ray call
per request or a poll per step:

    RemoteEngineCore ── Commands (adds, aborts, stats asks) ──► SchedulerActor
                     ◄── Events (engine-core outputs, rejections, stats, failure) ──

Outputs cross as the engine core emits them (`EngineCoreOutput`: a step's new token ids and
logprobs, no text and no history), so a long stream costs what it adds each step; the front
door's output processor makes text of them (cluster/output_processor.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvloom.cluster.outputs import EngineCoreOutput
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
    # A stop string ended them (the front door's output processor found it): they count as
    # finished, not aborted.
    stopped: bool = False


class AskStats(msgspec.Struct, tag="stats", array_like=True):
    ask_id: int


class Commands(msgspec.Struct, array_like=True):
    items: list[AddRequest | AbortRequests | AskStats]


class Rejection(msgspec.Struct, array_like=True):
    """A request the engine refused at admission: a bad one (`message` names the field),
    or any, once the engine is down (`engine_down`)."""

    request_id: str
    message: str
    engine_down: bool = False


class Events(msgspec.Struct, array_like=True):
    outputs: list[EngineCoreOutput] = []
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
