"""The engine as its users see it: prompts in, RequestOutputs (or stream deltas) out.

`OutputEngine` puts the one output processor (cluster/output_processor.py) in front of an
engine core: the in-process `EngineCore` (`Engine`), a scheduler actor's proxy
(`RemoteEngine`, cluster/scheduler_actor.py) or data-parallel replicas (`ReplicaSet`,
cluster/replicas.py). The core emits per-step token deltas; this side detokenizes, matches
stop strings (aborting a stopped request in the core at once, so its blocks return) and
builds outputs:

- `step()` -> cumulative RequestOutputs, as vLLM's `LLMEngine.step` (only finished ones for
  output_kind "final_only", which `LLM.generate` uses);
- `step_deltas()` -> OutputDeltas, which the front doors stream (no history copied).

The core's own attributes (scheduler, kv_cache, executor, config, ...) read through.
"""

from __future__ import annotations

from typing import Any

from kvloom.cluster.engine_channel import RequestError
from kvloom.cluster.engine_core import EngineCore
from kvloom.cluster.output_processor import OutputProcessor
from kvloom.cluster.outputs import OutputDelta, RequestOutput
from kvloom.cluster.shared_tokenizer import shared_tokenizer
from kvloom.cluster.tokenizer import Tokenizer
from kvloom.contracts.sampling_params import SamplingParams

PromptInput = str | list[int] | dict[str, Any]


class OutputEngine:
    def __init__(self, core: Any, tokenizer: Tokenizer | None = None):
        self.core = core
        self.tokenizer = tokenizer or shared_tokenizer(core.config.model.model)
        self.output_processor = OutputProcessor(self.tokenizer)

    def __getattr__(self, name: str) -> Any:
        # Only called for names this object lacks: the core's (scheduler, kv_cache, ...).
        if name == "core":  # not set yet (a failed __init__): no recursion
            raise AttributeError(name)
        return getattr(self.core, name)

    # -- requests -------------------------------------------------------------------
    def _prompt_ids(self, prompt: PromptInput) -> tuple[list[int], str | None, str | None]:
        cache_salt = None
        if isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt")
            if cache_salt is not None and not isinstance(cache_salt, str):
                raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt must have a 'prompt' or 'prompt_token_ids' key")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return self.tokenizer.encode(prompt), prompt, cache_salt
        return list(prompt), None, cache_salt

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queues a request. `arrival_time` (time.monotonic(); default now) is when it
        reached the caller: its time to first token counts from there."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(request_id)
        token_ids, text, salt = self._prompt_ids(prompt)
        if request_id in self.output_processor.states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.output_processor.add_request(request_id, token_ids, params, text)
        try:
            self.core.add_request(
                request_id, token_ids, params, cache_salt or salt, arrival_time, text
            )
        except BaseException:
            self.output_processor.forget(request_id)
            raise

    def abort_request(self, request_id: str | list[str]) -> list[RequestOutput]:
        """Ends the given requests (unknown or finished ids are ignored) and frees their
        blocks. Returns each aborted request's final output (finish_reason "abort", text
        with the detokenizer's hold-back flushed)."""
        return self._abort(request_id, cumulative=True)

    def abort_deltas(self, request_ids: list[str]) -> list[OutputDelta]:
        """As `abort_request`, with each request's final delta (what its stream still
        lacks: held-back text included)."""
        return self._abort(request_ids, cumulative=False)

    def _abort(self, request_id: str | list[str], cumulative: bool) -> list:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        finals = self.output_processor.abort(ids, cumulative=cumulative)
        if finals:
            self.core.abort_requests([out.request_id for out in finals])
        return finals

    def stream_only(self) -> None:
        """For a front door that reads only `step_deltas` / `abort_deltas`: logprobs are
        dropped once their delta is made (cumulative `step` outputs are then refused)."""
        self.output_processor.keep_history = False

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def next_request_id(self) -> str:
        return self.core.next_request_id()

    # -- stepping -------------------------------------------------------------------
    def step(self) -> list[RequestOutput | RequestError]:
        """Runs one scheduled step; returns the outputs of requests that advanced
        (cumulative, as vLLM's), and a RequestError for each request refused after
        admission (e.g. its grammar did not compile)."""
        return self._step(cumulative=True)

    def step_deltas(self) -> list[OutputDelta | RequestError]:
        """As `step`, with each request's OutputDelta (the front doors' streams)."""
        return self._step(cumulative=False)

    def _step(self, cumulative: bool) -> list:
        core_outputs = self.core.step()
        errors = [out for out in core_outputs if isinstance(out, RequestError)]
        if errors:
            core_outputs = [out for out in core_outputs if not isinstance(out, RequestError)]
            for error in errors:
                self.output_processor.forget(error.request_id)
        processed = self.output_processor.process(core_outputs, cumulative=cumulative)
        if processed.stopped:  # stop strings: end them in the core now (blocks return)
            self.core.abort_requests(processed.stopped, stopped=True)
        return processed.outputs + errors

    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    def shutdown(self) -> None:
        self.core.shutdown()


class Engine(OutputEngine):
    """The in-process engine: `Engine(model=..., **kwargs)` (ARCHITECTURE §7)."""

    def __init__(self, progress: bool = True, **kwargs: Any):
        core = EngineCore(progress=progress, **kwargs)
        super().__init__(core, core.tokenizer)
