"""The engine: requests in, one scheduled step at a time, RequestOutputs out."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

from kvloom.cluster.engine_channel import RequestError
from kvloom.cluster.executor import Executor, make_executor
from kvloom.cluster.kv_cache.coordinator import KVCacheCoordinator
from kvloom.cluster.kv_cache.planner import num_blocks_for_memory, plan_kv_cache
from kvloom.cluster.output_processor import OutputProcessor
from kvloom.cluster.outputs import RequestOutput
from kvloom.cluster.prompt_checks import check_prompt_token_ids
from kvloom.cluster.ray_executor import WorkerFailure
from kvloom.cluster.request import Request, RequestStatus
from kvloom.cluster.scheduler import Scheduler
from kvloom.cluster.structured_outputs import GrammarCompilers
from kvloom.cluster.tokenizer import Tokenizer
from kvloom.contracts.config import EngineConfig
from kvloom.contracts.sampling_params import SamplingParams

PromptInput = str | list[int] | dict[str, Any]


def _nothing_to_run(sched) -> bool:
    return sched.is_empty and not sched.finished_request_ids and not sched.blocks_to_poison


def _use_async_scheduling(config: EngineConfig, executor) -> bool:
    """On when asked; by default on where the device is CUDA (the steps it overlaps run
    on the device), with either executor: both launch a step ahead (`submit`), and with
    speculative decoding too (the step ahead gets placeholder drafts that the workers
    fill from their own proposals: docs/async_scheduling.md)."""
    wanted = config.scheduler.async_scheduling
    if wanted and not hasattr(executor, "submit"):
        raise ValueError(
            f"async_scheduling needs an executor that launches steps ahead; "
            f"{type(executor).__name__} does not"
        )
    if wanted is None:
        return hasattr(executor, "submit") and executor.device_type == "cuda"
    return wanted


class Engine:
    def __init__(self, progress: bool = True, **kwargs: Any):
        self.config = EngineConfig.from_kwargs(**kwargs)
        self.tokenizer = Tokenizer(self.config.model.model)
        self.executor: Executor = make_executor(self.config, progress=progress)
        try:
            self._build()
        except BaseException:  # a refused setting must not leak the workers (or a Ray PG)
            self.executor.shutdown()
            raise

    def _build(self) -> None:
        """Everything after the workers exist: KV cache, scheduler, output processing."""
        self.kv_cache_plan, num_blocks = self._plan_kv_cache()
        self.executor.initialize_kv_cache(self.kv_cache_plan, num_blocks)
        cache = self.config.cache
        if cache.block_size is None:  # chosen by the plan (planner.resolve_block_size)
            dcp = self.config.parallel.decode_context_parallel_size
            cache.block_size = self.kv_cache_plan.block_size // dcp
        self.kv_cache = KVCacheCoordinator(
            self.kv_cache_plan.groups,
            num_blocks,
            enable_caching=cache.enable_prefix_caching,
            sanitize=cache.sanitize,
            checkpoint_interval=cache.linear_state_checkpoint_interval,
            max_checkpoints=cache.max_linear_state_checkpoints,
            bytes_per_block=self.kv_cache_plan.bytes_per_block,
        )
        spec = self.config.speculative
        self.vocab_size = int(self.config.model.text_config["vocab_size"])
        self.grammars = GrammarCompilers(
            self.config.model.model, self.vocab_size, self.tokenizer.eos_token_ids
        )
        self.scheduler = Scheduler(
            self.config.scheduler,
            self.kv_cache,
            self.config.model.seed,
            speculative=spec,
            grammars=self.grammars,
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self._counter = itertools.count()
        self.num_finished = 0
        self.num_aborted = 0
        # Set when a worker failed: every request was ended with an error, and the engine
        # refuses new ones (fail fast; the process supervisor restarts it).
        self.failure: str | None = None
        # Async scheduling: the step launched ahead (SchedulerOutput, handle), if any.
        self._in_flight = None
        self.async_scheduling = _use_async_scheduling(self.config, self.executor)

    def _plan_kv_cache(self):
        """The KV-cache plan and pool size, made here from what the workers report (as
        vLLM's engine core does): their layers' specs, then the memory they can give the
        cache under the plan (unless `num_kv_blocks` fixes the size)."""
        config = self.config
        plan = plan_kv_cache(
            self.executor.kv_cache_specs(),
            config.cache,
            config.model.torch_dtype_name,
            config.parallel.decode_context_parallel_size,
        )
        if config.cache.num_kv_blocks is not None:
            return plan, config.cache.num_kv_blocks
        memory = self.executor.available_kv_memory(plan)
        return plan, num_blocks_for_memory(plan, memory, config.scheduler)

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
        return prompt, None, cache_salt

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
        if self.failure is not None:
            raise RuntimeError(f"engine is down: {self.failure}")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        token_ids, text, salt = self._prompt_ids(prompt)
        check_prompt_token_ids(token_ids, self.vocab_size, self.config.scheduler.max_model_len)
        if arrival_time is not None and (
            isinstance(arrival_time, bool) or not isinstance(arrival_time, int | float)
        ):
            raise ValueError(f"arrival_time must be a time.monotonic() value, got {arrival_time!r}")
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = replace(params, eos_token_ids=self.tokenizer.eos_token_ids)
        request = Request(
            request_id=str(request_id),
            prompt_token_ids=list(token_ids),
            sampling_params=params,
            prompt=text,
            cache_salt=cache_salt or salt,
        )
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.scheduler.add_request(request)
        self.outputs.add(request)

    def abort_request(self, request_id: str | list[str]) -> list[RequestOutput]:
        """Ends the given requests (unknown or finished ids are ignored) and frees their
        blocks. Returns each aborted request's final output (finish_reason "abort", text
        with the detokenizer's hold-back flushed)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        finals = []
        for rid in ids:
            request = self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            if request is not None:
                final = self.outputs.abort_output(request)
                finals += [final] if final is not None else []
                self.num_aborted += 1
        return finals

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def next_request_id(self) -> str:
        return str(next(self._counter))

    # -- stepping -------------------------------------------------------------------
    def step(self) -> list[RequestOutput | RequestError]:
        """Runs one scheduled step; returns outputs of requests that advanced, and a
        RequestError for each request refused after admission (its grammar did not compile).

        With async scheduling the next step is scheduled and launched before this one's
        output is read back, so the host's work overlaps the device's."""
        outputs = self._step()
        if self.scheduler.rejected:
            for request in self.scheduler.rejected:
                self.num_finished += 1
                outputs.append(self.outputs.make_output(request, finished=True))
            self.scheduler.rejected = []
        for request in self.scheduler.grammar_failures:
            self.outputs.abort_output(request)  # drops its text state
            outputs.append(RequestError(request.request_id, str(request.stop_reason)))
        self.scheduler.grammar_failures = []
        return outputs

    def _step(self) -> list[RequestOutput]:
        try:
            if self._in_flight is not None:
                sched, handle = self._in_flight
                self._in_flight = None
            else:
                sched = self.scheduler.schedule()
                if _nothing_to_run(sched):
                    return []
                if not self.async_scheduling:
                    return self._finish_step(sched, self.executor.execute_model(sched))
                handle = self.executor.submit(sched)
            if self.scheduler.can_schedule_ahead():
                ahead = self.scheduler.schedule()
                if not _nothing_to_run(ahead):
                    self._in_flight = (ahead, self.executor.submit(ahead))
            runner_out = handle.result()
        except Exception as err:  # a worker died or raised: end everything, loudly
            self._in_flight = None
            reason = str(err) if isinstance(err, WorkerFailure) else f"{type(err).__name__}: {err}"
            return self._fail_all(reason)
        return self._finish_step(sched, runner_out)

    def _finish_step(self, sched, runner_out) -> list[RequestOutput]:
        advanced, finished = self.scheduler.update_from_output(sched, runner_out)
        results = []
        for request in advanced:
            stop = self.outputs.process(request, runner_out.logprobs.get(request.request_id))
            if stop is not None and not request.status.finished:
                request.stop_reason = stop
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            elif stop is not None:
                request.stop_reason = stop
                request.status = RequestStatus.FINISHED_STOPPED
            done = request.status.finished
            self.num_finished += done
            if done or request.sampling_params.output_kind == "cumulative":
                results.append(self.outputs.make_output(request, finished=done))
        for request in finished:
            if request not in advanced:
                self.num_finished += 1
                results.append(self.outputs.make_output(request, finished=True))
        return results

    def _fail_all(self, reason: str) -> list[RequestOutput]:
        self.failure = reason
        results = []
        for request_id in list(self.scheduler.requests):
            request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
            request.stop_reason = reason
            self.num_finished += 1
            results.append(self.outputs.make_output(request, finished=True))
        return results

    def stats(self) -> dict[str, Any]:
        pool = self.kv_cache.pool
        prefix = self.kv_cache.stats
        return {
            "num_blocks": pool.capacity,
            "block_size": self.config.cache.block_size,
            "num_free_blocks": pool.num_free_blocks,
            "kv_cache_usage": self.kv_cache.usage,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.scheduler.num_steps,
            "num_finished": self.num_finished,
            "num_aborted": self.num_aborted,
            "prefix_cache_queried_tokens": prefix.queried_tokens,
            "prefix_cache_hit_tokens": prefix.hit_tokens,
            "prefix_cache_hit_rate": prefix.hit_tokens / max(prefix.queried_tokens, 1),
            "prefix_cache_hit_tokens_per_group": list(prefix.per_group_hit_tokens),
            "num_evictions": pool.num_evictions,
            **self.kv_cache.checkpoint_stats(),
            "spec_drafted_tokens": self.scheduler.spec_drafted,
            "spec_accepted_tokens": self.scheduler.spec_accepted,
            "spec_acceptance_rate": self.scheduler.spec_accepted
            / max(self.scheduler.spec_drafted, 1),
            # tokens emitted per verification step (accepted drafts + the target's token)
            "spec_mean_accepted_length": 1
            + self.scheduler.spec_accepted / max(self.scheduler.spec_steps, 1),
        }

    def shutdown(self) -> None:
        """Stops the workers (and frees a Ray placement group). Safe to call twice."""
        if getattr(self, "grammars", None) is not None:
            self.grammars.shutdown()
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None
