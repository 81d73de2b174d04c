"""The scheduler: continuous batching with no prefill or decode phase.

Each step every request's computed tokens catch up with its token count under one token
budget: running requests first (a decode is one token, a prefill chunk as many as fit),
then waiting ones in FCFS order. When the pool cannot hold a running request's next
tokens the newest running request is preempted by recompute: its blocks are freed and it
returns to the front of the queue, keeping its outputs.
"""

from __future__ import annotations

import random
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait

from kvloom.cluster.kv_cache.coordinator import KVCacheCoordinator
from kvloom.cluster.request import Request, RequestStatus
from kvloom.cluster.spec_decode.stats import AcceptanceCounts
from kvloom.cluster.structured_outputs import GrammarCompilers, RequestGrammar
from kvloom.contracts.config import SchedulerConfig, SpeculativeConfig
from kvloom.contracts.runner_output import ModelRunnerOutput
from kvloom.contracts.scheduler_output import (
    PLACEHOLDER_TOKEN_ID,
    CachedRequestData,
    GrammarBitmasks,
    NewRequestData,
    SchedulerOutput,
)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheCoordinator,
        seed: int = 0,
        speculative: SpeculativeConfig | None = None,
        grammars: GrammarCompilers | None = None,
    ):
        self.config = config
        self.kv_cache = kv_cache
        self.speculative = speculative or SpeculativeConfig()
        # Requests with drafts in a step not read back yet: how many such steps.
        self._drafts_in_flight: dict[str, int] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._seed_rng = random.Random(seed)
        self._sampling_seeds: dict[str, int] = {}
        # What the workers already know of each request: tokens and blocks per group.
        self._sent_tokens: dict[str, int] = {}
        self._sent_blocks: dict[str, list[int]] = {}
        self._forget: list[str] = []
        self.rejected: list[Request] = []  # ended by the scheduler itself; the engine reports them
        self.num_preemptions = 0
        self.num_steps = 0
        self.spec_drafted = 0
        self.spec_accepted = 0
        self.spec_steps = 0
        # Accepted drafts by position, for /metrics (vLLM's ..._per_pos counters).
        self.spec_counts = AcceptanceCounts()
        # Structured outputs: requests whose grammar is compiling (they enter the queue
        # when it is ready), and the matcher of each admitted one.
        self.grammars = grammars
        self._compiling: dict[str, tuple[Request, Future]] = {}
        self._grammar_of: dict[str, RequestGrammar] = {}
        # Requests whose grammar did not compile: refused (the engine reports each one as
        # a RequestError, the request's fault, not the engine's).
        self.grammar_failures: list[Request] = []
        # Grammar rows scheduled while their previous token was in flight (async
        # scheduling): their masks follow the step (`followed_bitmasks`).
        self.num_grammar_rows_ahead = 0

    # -- requests in and out --------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        seed = request.sampling_params.seed
        self._sampling_seeds[request.request_id] = (
            seed if seed is not None else self._seed_rng.getrandbits(63)
        )
        constraint = request.sampling_params.structured_outputs
        if constraint is not None:
            if self.grammars is None:
                raise ValueError("structured_outputs: this scheduler has no grammar compiler")
            future = self.grammars.submit(constraint)
            self.requests[request.request_id] = request
            self._compiling[request.request_id] = (request, future)
            return
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _admit_compiled(self) -> None:
        """Queues requests whose grammar is ready (FCFS among them); ends those whose
        grammar failed to compile with the compiler's message. Waits briefly only when
        nothing else could run, so compiling never stalls other requests."""
        if not self._compiling:
            return
        if not self.waiting and not self.running:
            futures = [future for _, future in self._compiling.values()]
            wait(futures, timeout=0.05, return_when=FIRST_COMPLETED)
        for request_id, (request, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            error = future.exception()
            if error is not None:
                request.stop_reason = str(error)
                self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
                self.grammar_failures.append(request)
                continue
            self._grammar_of[request_id] = RequestGrammar(future.result(), self.grammars.vocab_size)
            self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends a request (abort, or a stop string found by the output processor)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self._release(request)
        return request

    def _release(self, request: Request) -> None:
        self.kv_cache.free(request)
        self._sampling_seeds.pop(request.request_id, None)
        if self._sent_tokens.pop(request.request_id, None) is not None:
            self._forget.append(request.request_id)
        self._sent_blocks.pop(request.request_id, None)
        self._drafts_in_flight.pop(request.request_id, None)
        self._compiling.pop(request.request_id, None)
        self._grammar_of.pop(request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._compiling)

    # -- one step -------------------------------------------------------------------
    def _chunk_size(self, request: Request, budget: int) -> int:
        length = len(request.all_token_ids) + request.num_pending_output_tokens
        num_new = min(length - request.num_computed_tokens, budget)
        if self.config.long_prefill_token_threshold > 0:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        if not self.kv_cache.checkpoints_on:
            return num_new
        start = request.num_computed_tokens
        stop = self.kv_cache.prompt_checkpoint_length(request)
        if stop is not None and start < stop < start + num_new:
            # The prompt's linear-state checkpoint is kept one token before its end.
            num_new = stop - start
        interval = self.kv_cache.checkpoint_interval
        if interval:
            # End the chunk on the last checkpoint-interval boundary inside it, so a
            # linear-state checkpoint is kept there (linear_state_checkpoint_interval).
            boundary = (start + num_new) // interval * interval
            if boundary > start:
                num_new = boundary - start
        return num_new

    def _drafts_for(self, request: Request, budget_left: int) -> list[int]:
        """Drafts ride along only with a decode (one real token) and while budget lasts.

        A request whose newest step is still in flight (async scheduling) has no drafts
        here yet: it gets placeholder slots, which the worker fills from the proposals it
        made in that step. Their number assumes every draft in flight is accepted (the
        longest the request can be), so length limits hold whatever comes back."""
        if not self.speculative.num_speculative_tokens or request.restore_state:
            return []
        pending = request.num_pending_output_tokens
        if pending:
            length = request.num_tokens + pending
            if length - request.num_computed_tokens != 1:
                return []
            room = min(
                self.speculative.num_speculative_tokens,
                self._draft_room(request, pending),
                budget_left,
            )
            return [PLACEHOLDER_TOKEN_ID] * max(0, room)
        if not request.spec_token_ids:
            return []
        if request.num_tokens - request.num_computed_tokens != 1:
            return []
        return request.spec_token_ids[: max(0, budget_left)]

    def _draft_room(self, request: Request, pending: int = 0) -> int:
        """Drafts the request can still use: all but its next token's room under
        max_model_len and max_tokens, counting `pending` tokens in flight."""
        room = self.config.max_model_len - request.num_tokens - pending - 1
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - pending - 1)
        return room

    def _preempt(self, victim: Request) -> None:
        victim.spec_token_ids = []
        self.kv_cache.free(victim)  # reads restore_state: its state checkpoint is the backup
        victim.restore_state = False
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_pending_output_tokens = 0  # an in-flight token is recomputed later
        self._drafts_in_flight.pop(victim.request_id, None)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        if self._sent_tokens.pop(victim.request_id, None) is not None:
            self._forget.append(victim.request_id)
        self._sent_blocks.pop(victim.request_id, None)
        self.waiting.appendleft(victim)

    def schedule(self) -> SchedulerOutput:
        self._admit_compiled()
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        preempted = False

        drafts: dict[str, list[int]] = {}
        lookahead = self.speculative.num_lookahead_slots
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self._ends_with_pending_token(request):
                index += 1  # its in-flight token is its last: nothing more to schedule
                continue
            if self.kv_cache.has_linear_groups and request.request_id in self._drafts_in_flight:
                index += 1  # a rejected draft rolls its linear state back: wait for the count
                continue
            if (
                request.num_pending_output_tokens
                and request.request_id in self._grammar_of
                and self.speculative.enabled
            ):
                index += 1  # drafts are checked against the matcher: wait for its token
                continue
            num_new = self._chunk_size(request, budget)
            spec = self._drafts_for(request, budget - num_new)
            grammar = self._grammar_of.get(request.request_id)
            if spec and grammar is not None:  # drafts the grammar forbids cannot be accepted
                spec = spec[: grammar.valid_draft_prefix(spec)]
            while not self.kv_cache.allocate_slots(
                request, num_new, num_draft_tokens=len(spec), num_lookahead_tokens=lookahead
            ):
                victim = self.running.pop()
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id)
                    drafts.pop(victim.request_id, None)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    if not self.running and not scheduled:
                        # Alone in an idle pool and still no room for its next chunk: it
                        # would be rescheduled and preempted forever.
                        self._reject_unfittable(request)
                    break
            else:
                if request.restore_state:
                    self.kv_cache.restore_state(request)
                    request.restore_state = False
                if spec:
                    drafts[request.request_id] = spec
                scheduled[request.request_id] = num_new + len(spec)
                budget -= num_new + len(spec)
                index += 1

        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            hit = self.kv_cache.find_cache_hit(request)
            request.num_computed_tokens = hit.num_tokens
            num_new = self._chunk_size(request, budget)
            if not self.kv_cache.allocate_slots(
                request, num_new, hit.blocks, num_lookahead_tokens=lookahead
            ):
                request.num_computed_tokens = 0
                if not hit.num_tokens or self.running or scheduled:
                    break
                # An idle pool whose free state runs all hold a page of this hit: start
                # over without the hit rather than wait forever.
                hit = self.kv_cache.no_hit()
                num_new = self._chunk_size(request, budget)
                if not self.kv_cache.allocate_slots(
                    request, num_new, num_lookahead_tokens=lookahead
                ):
                    break
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = hit.num_tokens
                self.kv_cache.record_hit(request, hit)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request.request_id] = num_new
            budget -= num_new

        if not scheduled and not self.running and self.waiting and not preempted:
            self._reject_unfittable(self.waiting[0])
        out = self._build_output(scheduled, drafts)
        self._advance_scheduled(scheduled, drafts)
        return out

    def _reject_unfittable(self, request: Request) -> None:
        """The head of the queue cannot get its next chunk's pages even from an idle pool:
        it would wait forever and block everyone behind it. End it with an error."""
        total = self.kv_cache.pool.num_blocks - 1  # block 0 is the null block
        request.stop_reason = (
            f"the KV cache cannot hold this request: it needs more than the pool's {total} "
            f"blocks at {request.num_tokens} tokens (raise num_kv_blocks / "
            "gpu_memory_utilization, or lower max_tokens)"
        )
        self.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
        self.rejected.append(request)

    def _advance_scheduled(self, scheduled: dict[str, int], drafts: dict) -> None:
        """Counts the scheduled tokens as computed now, so a next step can be scheduled
        before this one's results are back (`update_from_output` takes back rejected
        drafts). A step that reaches a request's end samples a token, and one more per
        draft if all are accepted: pending until then (`update_from_output` corrects by
        the rejected ones)."""
        for request_id, num_tokens in scheduled.items():
            request = self.requests[request_id]
            request.num_computed_tokens += num_tokens
            num_drafts = len(drafts.get(request_id, ()))
            real = request.num_computed_tokens - num_drafts
            if real == request.num_tokens + request.num_pending_output_tokens:
                request.num_pending_output_tokens += 1 + num_drafts
            if num_drafts:
                in_flight = self._drafts_in_flight.get(request_id, 0)
                self._drafts_in_flight[request_id] = in_flight + 1

    def _ends_with_pending_token(self, request: Request) -> bool:
        """Whether the token a step in flight samples for it ends it by length."""
        pending = request.num_pending_output_tokens
        if not pending:
            return False
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and request.num_output_tokens + pending >= max_tokens:
            return True
        return request.num_tokens + pending >= self.config.max_model_len

    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled before this one's tokens are back. Always:
        with speculative decoding the step ahead gets placeholder drafts (`_drafts_for`)."""
        return True

    def _build_output(
        self, scheduled: dict[str, int], drafts: dict[str, list[int]]
    ) -> SchedulerOutput:
        copies = self.kv_cache.drain_copies(scheduled)
        out = SchedulerOutput(
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            finished_request_ids=self._forget,
            blocks_to_poison=self.kv_cache.pool.drain_poison_list(),
            state_copies_before=copies.before,
            state_copies_after=copies.after,
            scheduled_spec_token_ids=drafts,
            step_id=self.num_steps,
        )
        self._forget = []
        kv_cache = self.kv_cache
        for request_id, num_tokens in scheduled.items():
            request = self.requests[request_id]
            grammar = self._grammar_of.get(request_id)
            if grammar is not None:
                self._add_grammar_mask(out, request, grammar, num_tokens, drafts)
            num_blocks = kv_cache.num_blocks(request_id)
            sent_tokens = self._sent_tokens.get(request_id)
            if sent_tokens is None:
                out.new_requests.append(
                    NewRequestData(
                        request_id=request_id,
                        token_ids=list(request.all_token_ids),
                        sampling_params=request.sampling_params,
                        block_ids=kv_cache.block_ids(request_id),
                        num_computed_tokens=request.num_computed_tokens,
                        num_output_tokens=request.num_output_tokens,
                        sampling_seed=self._sampling_seeds[request_id],
                    )
                )
            else:
                # Only what the workers lack: copying every block id of every running
                # request each step costs milliseconds at a thousand requests.
                sent_blocks = self._sent_blocks[request_id]
                out.cached_requests.append(
                    CachedRequestData(
                        request_id=request_id,
                        new_token_ids=request.all_token_ids[sent_tokens:],
                        new_block_ids=kv_cache.new_block_ids(request_id, sent_blocks)
                        if num_blocks != sent_blocks
                        else tuple([] for _ in num_blocks),
                        num_computed_tokens=request.num_computed_tokens,
                    )
                )
            self._sent_tokens[request_id] = request.num_tokens
            self._sent_blocks[request_id] = num_blocks
        self.num_steps += 1
        return out

    def _add_grammar_mask(self, out, request, grammar, num_tokens: int, drafts: dict) -> None:
        request_id = request.request_id
        spec = drafts.get(request_id, ())
        if request.num_pending_output_tokens:
            # Its matcher lacks the token in flight: the mask follows (async scheduling).
            out.grammar_bitmasks_follow.append(request_id)
            self.num_grammar_rows_ahead += 1
        elif request.num_computed_tokens + num_tokens - len(spec) >= request.num_tokens:
            # This step samples its next token(s): the grammar says which are allowed.
            out.grammar_bitmasks[request_id] = grammar.draft_bitmasks(list(spec))

    def followed_bitmasks(self, sched_out: SchedulerOutput) -> GrammarBitmasks:
        """The masks of a step scheduled ahead, once the step before it was read back
        (`update_from_output` advanced the matchers by its tokens). A request that step
        ended (EOS, a completed grammar, a stop, an abort) or preempted gets none: its row
        is sampled unmasked and discarded, as any row of a request gone meanwhile."""
        masks = GrammarBitmasks(sched_out.step_id)
        for request_id in sched_out.grammar_bitmasks_follow:
            grammar = self._grammar_of.get(request_id)
            request = self.requests.get(request_id)
            if grammar is None or request is None or request.status != RequestStatus.RUNNING:
                continue
            masks.bitmasks[request_id] = grammar.next_token_bitmask()
        return masks

    # -- after the step -------------------------------------------------------------
    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> tuple[list[Request], list[Request]]:
        """Advances requests by what was computed; returns (advanced, newly finished)."""
        advanced, finished = [], []
        now = time.monotonic()  # one clock read for every token of this step
        for request_id, num_tokens in sched_out.num_scheduled_tokens.items():
            spec = sched_out.scheduled_spec_token_ids.get(request_id, [])
            if spec:
                self._draft_step_done(request_id)
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            new_tokens = runner_out.sampled_token_ids.get(request_id, [])
            # Counted as computed when scheduled (`_advance_scheduled`); rejected drafts
            # (and placeholder slots the worker had no proposal for) are taken back and
            # recomputed over later.
            computed_before = request.num_computed_tokens - num_tokens
            num_rejected = len(spec) + 1 - len(new_tokens) if spec else 0
            request.num_computed_tokens -= num_rejected
            if new_tokens:
                pending = request.num_pending_output_tokens - 1 - len(spec)
                request.num_pending_output_tokens = max(0, pending)
            drafted = runner_out.num_draft_tokens.get(request_id, len(spec))
            if drafted:
                self._record_spec(request, drafted, len(new_tokens) - 1)
                if num_rejected and self.kv_cache.has_linear_groups:
                    # The linear state advanced over rejected drafts: restore the backup
                    # next step and recompute the accepted tokens from it.
                    request.num_computed_tokens = computed_before
                    request.restore_state = True
            if request.spec_token_ids:
                request.spec_token_ids = []
            self.kv_cache.publish_computed_blocks(request)
            grammar = self._grammar_of.get(request_id)
            for token_id in new_tokens:
                request.append_output_token(token_id, now)
                status = None if grammar is None else self._check_grammar(request, grammar)
                status = status or self._check_stop(request, token_id)
                if status is not None:
                    request.status = status
                    break
            if new_tokens:
                advanced.append(request)
            if request.status.finished:
                self.running.remove(request)
                del self.requests[request_id]
                self._release(request)
                finished.append(request)
        self._propose(runner_out)
        return advanced, finished

    # -- speculative decoding -------------------------------------------------------
    def _draft_step_done(self, request_id: str) -> None:
        left = self._drafts_in_flight.get(request_id, 0) - 1
        if left > 0:
            self._drafts_in_flight[request_id] = left
        else:
            self._drafts_in_flight.pop(request_id, None)

    def _record_spec(self, request: Request, drafted: int, accepted: int) -> None:
        request.num_drafted_tokens += drafted
        request.num_accepted_tokens += accepted
        request.num_spec_steps += 1
        self.spec_drafted += drafted
        self.spec_accepted += accepted
        self.spec_steps += 1
        self.spec_counts.add(drafted, accepted)

    def _propose(self, runner_out: ModelRunnerOutput) -> None:
        """The workers' drafts (every proposer runs there) for each running request in
        decode, within its length limits. A request with a step in flight gets
        placeholders instead (`_drafts_for`): these drafts are the worker's already."""
        if not self.speculative.num_speculative_tokens:
            return
        for request in self.running:
            if request.num_tokens - request.num_computed_tokens != 1 or request.restore_state:
                continue
            if request.num_pending_output_tokens:
                continue
            spec = runner_out.spec_token_ids.get(request.request_id, [])
            request.spec_token_ids = list(spec[: max(0, self._draft_room(request))])

    def _check_grammar(self, request: Request, grammar: RequestGrammar) -> RequestStatus | None:
        """Advances the request's matcher by its newest token: a completed grammar ends
        the request ("stop"); a token outside it (only where nothing allowed could be
        sampled, e.g. min_tokens banning the stop token the grammar requires) is an error."""
        token_id = request.output_token_ids[-1]
        if not grammar.accept(token_id):
            request.stop_reason = (
                f"structured_outputs: token {token_id} is outside the grammar (the sampler "
                "had no allowed token left; check min_tokens and stop_token_ids)"
            )
            return RequestStatus.FINISHED_ERROR
        if grammar.terminated:
            request.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        return None

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in params.eos_token_ids:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
