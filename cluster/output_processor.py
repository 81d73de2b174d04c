"""The one output path: engine-core outputs (token ids) -> text, stop strings, logprobs.

Every user of the engine goes through one `OutputProcessor` per front door: `Engine.step`
and `LLM.generate` (cumulative RequestOutputs, as vLLM's), and the gRPC and HTTP doors
(per-step `OutputDelta`s, streamed and fed to the reasoning and tool-call parsers). For
each request it keeps an incremental detokenizer (never splits a multi-byte character) and
a stop-string matcher; a matched stop string ends the request here, and `process` names it
in `stopped` so the caller aborts it in the engine core at once (its blocks return). A
stream's text is held back while it may be the start of a stop string, and flushed with
the finished delta (invariant 8).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvloom.cluster.detokenizer import IncrementalDetokenizer
from kvloom.cluster.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    Logprob,
    OutputDelta,
    RequestOutput,
)
from kvloom.cluster.stop_strings import StopStringMatcher
from kvloom.cluster.tokenizer import Tokenizer
from kvloom.contracts.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: str
    detokenizer: IncrementalDetokenizer | None  # None: detokenize=False
    stops: StopStringMatcher | None
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of `text` handed out in deltas
    stop_string: str | None = None
    num_cached_tokens: int = 0


@dataclass
class ProcessedOutputs:
    # OutputDeltas (delta mode) or RequestOutputs (cumulative mode)
    outputs: list = field(default_factory=list)
    # Requests a stop string ended while the engine core still runs them: abort them there.
    stopped: list[str] = field(default_factory=list)


class OutputProcessor:
    """`keep_history` off (a front door that reads deltas only): a request's logprobs are
    not kept past the step that made them, so a long stream with logprobs holds no growing
    heap of them; cumulative outputs then cannot be made."""

    def __init__(self, tokenizer: Tokenizer, keep_history: bool = True):
        self.tokenizer = tokenizer
        self.keep_history = keep_history
        self.states: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> None:
        if request_id in self.states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        wants_logprobs = params.logprobs is not None
        self.states[request_id] = RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            output_kind=params.output_kind,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens
            )
            if params.detokenize
            else None,
            stops=StopStringMatcher(params.stop, params.include_stop_str_in_output)
            if params.stop and params.detokenize
            else None,
            logprobs=[] if wants_logprobs else None,
            cumulative_logprob=0.0 if wants_logprobs else None,
        )

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    # -- a step's outputs ----------------------------------------------------------------
    def process(
        self, core_outputs: list[EngineCoreOutput], cumulative: bool = False
    ) -> ProcessedOutputs:
        """One step of the engine core. `cumulative`: RequestOutputs for `Engine.step`
        (every advanced request of output_kind "cumulative", and every finished one); else
        one OutputDelta per output. Outputs of requests that ended here already (a stop
        string, an abort) are dropped."""
        if cumulative and not self.keep_history:
            raise RuntimeError("cumulative outputs need keep_history (this processor streams)")
        result = ProcessedOutputs()
        for out in core_outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue
            if state.logprobs and not self.keep_history:
                state.logprobs = []  # the previous step's, already handed out
            logprobs_before = len(state.logprobs) if state.logprobs is not None else 0
            finish_reason, stop_reason = self._advance(state, out)
            finished = finish_reason is not None
            if finished:
                del self.states[out.request_id]
                if not out.finished:
                    result.stopped.append(out.request_id)
            if cumulative:
                if finished or state.output_kind == "cumulative":
                    result.outputs.append(
                        _request_output(state, finish_reason, stop_reason, out.metrics)
                    )
            else:
                result.outputs.append(
                    self._delta(state, out, finish_reason, stop_reason, logprobs_before)
                )
        return result

    def _advance(self, state: RequestState, out: EngineCoreOutput) -> tuple:
        """Takes the output's tokens and logprobs in; returns (finish reason, stop reason)
        after stop strings, which override the core's (a stop string ends with "stop")."""
        new = out.new_token_ids
        state.token_ids += new
        state.num_cached_tokens = out.num_cached_tokens
        if state.logprobs is not None and out.new_logprobs:
            for token_id, (chosen, rank, top) in zip(new, out.new_logprobs):
                entry = {tid: Logprob(lp, r + 1) for r, (tid, lp) in enumerate(top)}
                entry.setdefault(token_id, Logprob(chosen, rank))
                state.logprobs.append(entry)
                state.cumulative_logprob += chosen
        detokenizer = state.detokenizer
        if detokenizer is not None:
            detokenizer.push(new[:-1] if out.ended_by_stop_token else new)
            if out.finished:
                detokenizer.flush()
            state.text = detokenizer.text
            self._match_stops(state)
        if state.stop_string is not None and out.finish_reason != "error":
            return "stop", state.stop_string
        return out.finish_reason, out.stop_reason

    @staticmethod
    def _match_stops(state: RequestState) -> None:
        if state.stops is None:
            return
        match = state.stops.check(state.text)
        if match is not None:
            state.text, state.stop_string = match

    @staticmethod
    def _delta(
        state: RequestState,
        out: EngineCoreOutput,
        finish_reason: str | None,
        stop_reason,
        logprobs_from: int,
    ) -> OutputDelta:
        text = state.text
        finished = finish_reason is not None
        if finished or state.stops is None:
            limit = len(text)
        else:
            limit = max(state.stops.safe_length(text), state.sent)
        delta_text = text[state.sent : limit] if limit > state.sent else ""
        state.sent = max(limit, state.sent)
        new = out.new_token_ids
        return OutputDelta(
            request_id=state.request_id,
            text=delta_text,
            token_ids=new,
            logprobs=state.logprobs[logprobs_from:] if state.logprobs else [],
            finished=finished,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            prompt_tokens=len(state.prompt_token_ids),
            completion_tokens=len(state.token_ids),
            cached_tokens=state.num_cached_tokens,
            cumulative_logprob=state.cumulative_logprob,
            metrics=out.metrics or {},
        )

    # -- aborts --------------------------------------------------------------------------
    def abort(self, request_ids: list[str], cumulative: bool = False) -> list:
        """Ends the requests (unknown or finished ids are ignored) and returns each one's
        final output, finish_reason "abort": the detokenizer's UTF-8 hold-back is flushed
        (and the text cut at a stop string, should the flushed tail complete one), so no
        character is lost (invariant 8)."""
        if cumulative and not self.keep_history:
            raise RuntimeError("cumulative outputs need keep_history (this processor streams)")
        finals = []
        for rid in dict.fromkeys(request_ids):
            state = self.states.pop(rid, None)
            if state is None:
                continue
            reason, stop_reason = "abort", None
            if state.detokenizer is not None:
                state.detokenizer.flush()
                state.text = state.detokenizer.text
                self._match_stops(state)
            if cumulative:
                finals.append(_request_output(state, reason, stop_reason, None))
            else:
                end = EngineCoreOutput(rid, [], num_cached_tokens=state.num_cached_tokens)
                finals.append(
                    self._delta(state, end, reason, stop_reason, len(state.logprobs or ()))
                )
        return finals


def _request_output(
    state: RequestState, finish_reason: str | None, stop_reason, metrics: dict | None
) -> RequestOutput:
    """The cumulative view (copies of the ids and logprobs so far, as vLLM's outputs)."""
    completion = CompletionOutput(
        index=0,
        text=state.text,
        token_ids=list(state.token_ids),
        cumulative_logprob=state.cumulative_logprob,
        logprobs=list(state.logprobs) if state.logprobs is not None else None,
        finish_reason=finish_reason,
        stop_reason=stop_reason,
    )
    return RequestOutput(
        request_id=state.request_id,
        prompt=state.prompt,
        prompt_token_ids=list(state.prompt_token_ids),
        outputs=[completion],
        finished=finish_reason is not None,
        num_cached_tokens=state.num_cached_tokens,
        metrics=dict(metrics or {}),
    )
