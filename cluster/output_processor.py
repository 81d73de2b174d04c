"""Turns sampled token ids into RequestOutputs: detokenization, stop strings, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvloom.cluster.detokenizer import IncrementalDetokenizer
from kvloom.cluster.outputs import CompletionOutput, Logprob, RequestOutput
from kvloom.cluster.request import Request, RequestStatus
from kvloom.cluster.stop_strings import StopStringMatcher
from kvloom.cluster.tokenizer import Tokenizer


@dataclass
class RequestTextState:
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    num_tokens_seen: int = 0
    stop_string: str | None = None
    extra: dict = field(default_factory=dict)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestTextState] = {}

    def add(self, request: Request) -> None:
        params = request.sampling_params
        self.states[request.request_id] = RequestTextState(
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.skip_special_tokens
            ),
            stops=StopStringMatcher(params.stop, params.include_stop_str_in_output),
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
        )

    def process(self, request: Request, logprob_infos: list | None) -> str | None:
        """Consumes the request's new tokens; returns a matched stop string, if any."""
        state = self.states[request.request_id]
        new_tokens = request.output_token_ids[state.num_tokens_seen :]
        state.num_tokens_seen = request.num_output_tokens
        if state.logprobs is not None:
            for token_id, (chosen, rank, top) in zip(new_tokens, logprob_infos or []):
                entry = {tid: Logprob(lp, r + 1) for r, (tid, lp) in enumerate(top)}
                entry.setdefault(token_id, Logprob(chosen, rank))
                state.logprobs.append(entry)
                state.cumulative_logprob += chosen
        if state.stop_string is not None:
            return state.stop_string
        if not request.sampling_params.detokenize:
            return None
        if _ended_by_stop_token(request) and new_tokens:
            new_tokens = new_tokens[:-1]  # the EOS / stop token is not part of the text
        state.detokenizer.push(new_tokens)
        if request.status.finished:
            state.detokenizer.flush()
        state.text = state.detokenizer.text
        match = state.stops.check(state.text)
        if match is not None:
            state.text, state.stop_string = match
        return state.stop_string

    def abort_output(self, request: Request) -> RequestOutput | None:
        """The final output of an aborted request: the detokenizer's UTF-8 hold-back is
        flushed (and the text cut at a stop string, should the flushed tail complete one),
        so no character is lost (invariant 8). Drops the request's text state; None when
        its final output was already made."""
        state = self.states.get(request.request_id)
        if state is None:
            return None
        if state.stop_string is None and request.sampling_params.detokenize:
            state.detokenizer.flush()
            state.text = state.detokenizer.text
            match = state.stops.check(state.text)
            if match is not None:
                state.text, state.stop_string = match
        return self.make_output(request, finished=True)

    def make_output(self, request: Request, finished: bool) -> RequestOutput:
        state = self.states[request.request_id]
        completion = CompletionOutput(
            index=0,
            text=state.text,
            token_ids=list(request.output_token_ids),
            cumulative_logprob=state.cumulative_logprob,
            logprobs=list(state.logprobs) if state.logprobs is not None else None,
            finish_reason=request.finish_reason if finished else None,
            stop_reason=request.stop_reason,
        )
        if finished:
            del self.states[request.request_id]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            outputs=[completion],
            finished=finished,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            metrics={**latency_metrics(request), **spec_metrics(request)},
        )


def latency_metrics(request: Request) -> dict:
    """ttft_s: arrival to the first output token; tpot_s: mean time per output token after
    the first (the request's inter-token latency). Measured where the engine receives the
    tokens, so they include queueing and scheduling, not the network."""
    if request.first_token_time is None:
        return {}
    metrics = {"ttft_s": request.first_token_time - request.arrival_time}
    if request.num_output_tokens > 1:
        span = request.last_token_time - request.first_token_time
        metrics["tpot_s"] = span / (request.num_output_tokens - 1)
    return metrics


def spec_metrics(request: Request) -> dict:
    if not request.num_spec_steps:
        return {}
    return {
        "spec_drafted_tokens": request.num_drafted_tokens,
        "spec_accepted_tokens": request.num_accepted_tokens,
        "spec_acceptance_rate": request.num_accepted_tokens / max(request.num_drafted_tokens, 1),
        "spec_mean_accepted_length": 1 + request.num_accepted_tokens / request.num_spec_steps,
    }


def _ended_by_stop_token(request: Request) -> bool:
    if request.status != RequestStatus.FINISHED_STOPPED or not request.output_token_ids:
        return False
    last = request.output_token_ids[-1]
    params = request.sampling_params
    return (not params.ignore_eos and last in params.eos_token_ids) or last in params.stop_token_ids
