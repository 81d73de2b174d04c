"""The engine core: token-id requests in, one scheduled step at a time, per-step deltas out.

It owns the scheduler, the KV-cache coordinator and the executor (workers), and emits for
each request that advanced an `EngineCoreOutput`: the new token ids, their raw logprobs,
the finish reason and the cached-token count, never text nor the request's history. Text,
stop strings and cumulative outputs are the output processor's (cluster/output_processor.py),
which runs wherever the front door is: in this process (`Engine`, `LLM`, `kvloom serve`
in-process) or in the front door's process when this core runs in a Ray actor.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

from kvloom.cluster.engine_channel import RequestError
from kvloom.cluster.executor import Executor, make_executor
from kvloom.cluster.kv_cache.coordinator import KVCacheCoordinator
from kvloom.cluster.kv_cache.planner import num_blocks_for_memory, plan_kv_cache
from kvloom.cluster.outputs import EngineCoreOutput
from kvloom.cluster.prompt_checks import check_prompt_token_ids
from kvloom.cluster.ray_executor import WorkerFailure
from kvloom.cluster.request import Request, RequestStatus
from kvloom.cluster.scheduler import Scheduler
from kvloom.cluster.shared_tokenizer import shared_tokenizer
from kvloom.cluster.structured_outputs import GrammarCompilers
from kvloom.contracts.config import EngineConfig
from kvloom.contracts.sampling_params import SamplingParams


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


class EngineCore:
    def __init__(self, progress: bool = True, **kwargs: Any):
        self.config = EngineConfig.from_kwargs(**kwargs)
        self.tokenizer = shared_tokenizer(self.config.model.model)
        self.executor: Executor = make_executor(self.config, progress=progress)
        try:
            self._build()
        except BaseException:  # a refused setting must not leak the workers (or a Ray PG)
            self.executor.shutdown()
            raise

    def _build(self) -> None:
        """Everything after the workers exist: KV cache, scheduler."""
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
        self._counter = itertools.count()
        self.num_finished = 0
        self.num_aborted = 0
        # request id -> output tokens already emitted (the next output starts there)
        self._emitted: dict[str, int] = {}
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
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        prompt: str | None = None,
    ) -> None:
        """Queues a request. `arrival_time` (time.monotonic(); default now) is when it
        reached the caller: its time to first token counts from there."""
        if self.failure is not None:
            raise RuntimeError(f"engine is down: {self.failure}")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")
        check_prompt_token_ids(
            prompt_token_ids, self.vocab_size, self.config.scheduler.max_model_len
        )
        if arrival_time is not None and (
            isinstance(arrival_time, bool) or not isinstance(arrival_time, int | float)
        ):
            raise ValueError(f"arrival_time must be a time.monotonic() value, got {arrival_time!r}")
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = replace(params, eos_token_ids=self.tokenizer.eos_token_ids)
        request = Request(
            request_id=str(request_id),
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            prompt=prompt,
            cache_salt=cache_salt,
        )
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.scheduler.add_request(request)
        self._emitted[request.request_id] = 0

    def abort_requests(self, request_ids: list[str], stopped: bool = False) -> list[str]:
        """Ends the requests (unknown or finished ids are ignored) and frees their blocks at
        once; emits nothing (the output processor ends their streams itself). `stopped`:
        a stop string ended them (counted as finished, not aborted). Returns the ids ended."""
        status = RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_ABORTED
        ended = []
        for rid in request_ids:
            request = self.scheduler.finish_request(rid, status)
            if request is None:
                continue
            self._emitted.pop(rid, None)
            ended.append(rid)
            if stopped:
                self.num_finished += 1
            else:
                self.num_aborted += 1
        return ended

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def next_request_id(self) -> str:
        return str(next(self._counter))

    # -- stepping -------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput | RequestError]:
        """Runs one scheduled step; returns an output per request that advanced or ended,
        and a RequestError for each request refused after admission (its grammar did not
        compile).

        With async scheduling the next step is scheduled and launched before this one's
        output is read back, so the host's work overlaps the device's."""
        outputs: list[EngineCoreOutput | RequestError] = list(self._step())
        if self.scheduler.rejected:
            for request in self.scheduler.rejected:
                self.num_finished += 1
                outputs.append(self._final(request, []))
            self.scheduler.rejected = []
        for request in self.scheduler.grammar_failures:
            self._emitted.pop(request.request_id, None)
            outputs.append(RequestError(request.request_id, str(request.stop_reason)))
        self.scheduler.grammar_failures = []
        return outputs

    def _step(self) -> list[EngineCoreOutput]:
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
            return self._fail_all(_failure_reason(err))
        results = self._finish_step(sched, runner_out)
        try:
            self._send_followed_masks()
        except Exception as err:
            self._in_flight = None
            return results + self._fail_all(_failure_reason(err))
        return results

    def _send_followed_masks(self) -> None:
        """The step ahead's grammar rows were scheduled while their previous token was
        in flight; now that it is read back and their matchers advanced, their masks go
        to the workers, which sample that step only then (vLLM's order: the scheduler
        output first, the bitmask after the previous step's tokens)."""
        if self._in_flight is None or not self._in_flight[0].grammar_bitmasks_follow:
            return
        self.executor.send_bitmasks(self.scheduler.followed_bitmasks(self._in_flight[0]))

    def _finish_step(self, sched, runner_out) -> list[EngineCoreOutput]:
        advanced, finished = self.scheduler.update_from_output(sched, runner_out)
        results = []
        logprobs = runner_out.logprobs
        for request in advanced:
            rid = request.request_id
            start = self._emitted.get(rid, 0)
            new = request.output_token_ids[start:]
            self._emitted[rid] = start + len(new)
            raw = logprobs.get(rid) if request.sampling_params.logprobs is not None else None
            if raw is not None and len(raw) > len(new):
                raw = raw[: len(new)]  # a stop inside a step's accepted drafts
            if request.status.finished:
                self.num_finished += 1
                results.append(self._final(request, new, raw))
            else:
                results.append(
                    EngineCoreOutput(
                        rid, new, raw, num_cached_tokens=max(request.num_cached_tokens, 0)
                    )
                )
        for request in finished:
            if request not in advanced:
                self.num_finished += 1
                results.append(self._final(request, []))
        return results

    def _final(self, request: Request, new: list[int], raw: list | None = None) -> EngineCoreOutput:
        self._emitted.pop(request.request_id, None)
        return EngineCoreOutput(
            request.request_id,
            new,
            raw,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            ended_by_stop_token=bool(new) and _ended_by_stop_token(request),
            num_cached_tokens=max(request.num_cached_tokens, 0),
            metrics={**latency_metrics(request), **spec_metrics(request)},
        )

    def _fail_all(self, reason: str) -> list[EngineCoreOutput]:
        self.failure = reason
        results = []
        for request_id in list(self.scheduler.requests):
            request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
            request.stop_reason = reason
            self.num_finished += 1
            results.append(self._final(request, []))
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
            "spec_num_drafts": self.scheduler.spec_steps,
            "spec_drafted_tokens": self.scheduler.spec_drafted,
            "spec_accepted_tokens": self.scheduler.spec_accepted,
            "spec_acceptance_rate": self.scheduler.spec_accepted
            / max(self.scheduler.spec_drafted, 1),
            # tokens emitted per verification step (accepted drafts + the target's token)
            "spec_mean_accepted_length": 1
            + self.scheduler.spec_accepted / max(self.scheduler.spec_steps, 1),
            "spec_accepted_tokens_per_position": list(
                self.scheduler.spec_counts.accepted_by_position
            ),
            # placement "remote": whether the drafter actor answers (docs/speculative.md)
            **self._drafter_stats(),
        }

    def _drafter_stats(self) -> dict[str, Any]:
        available = getattr(self.executor, "drafter_available", None)
        answer = available() if available is not None else None
        return {} if answer is None else {"spec_drafter_available": answer}

    def shutdown(self) -> None:
        """Stops the workers (and frees a Ray placement group). Safe to call twice."""
        if getattr(self, "grammars", None) is not None:
            self.grammars.shutdown()
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None


def _failure_reason(err: Exception) -> str:
    return str(err) if isinstance(err, WorkerFailure) else f"{type(err).__name__}: {err}"


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
