"""Async scheduling over the Ray executor: step N+1 is published on the step channel before
step N's result is read, and the workers pipeline (N+1 launched behind N, reading N's
sampled ids on the device). Tokens must be the synchronous engine's (float64, exact) with
preemption, prefix-cache hits, aborts and seeded sampling, at TP 1 and 2; a dead worker
still fails every request fast."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvloom import Engine, SamplingParams
from kvloom.cluster.engine_core import _use_async_scheduling
from tests.engine_helpers import (
    PROMPTS,
    assert_pool_full,
    greedy,
    kill_worker_mid_run,
    multi_turn,
    run_to_completion,
)

PARAMS = [
    greedy(10),
    SamplingParams(max_tokens=1, temperature=0.0),
    SamplingParams(max_tokens=9, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=0.7, top_k=20, seed=5, logprobs=2),
    SamplingParams(max_tokens=10, temperature=0.0, min_tokens=4),
    SamplingParams(max_tokens=10, temperature=1.0, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
    greedy(10),
]
# Small pools and budgets: requests get preempted while a step is in flight.
SETTINGS = {
    "dense": dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=16),
    # A tiny Qwen3-Next state spans several 16-token pages: 30 pages still preempt.
    "qwen3_next": dict(block_size=16, num_kv_blocks=30, max_num_batched_tokens=16),
}


def make_engine(path, settings, **kw) -> Engine:
    return Engine(
        model=str(path),
        dtype="float64",
        device="cpu",
        progress=False,
        enable_prefix_caching=True,
        **settings,
        **kw,
    )


def abort_mid_run(engine: Engine) -> dict[str, list[int]]:
    """Four requests; two are aborted while a step is in flight. The survivors' tokens."""
    ids = [f"abort-{i}" for i in range(4)]
    for rid, prompt in zip(ids, PROMPTS[4:]):
        engine.add_request(rid, {"prompt_token_ids": prompt}, greedy(12))
    engine.step()
    engine.step()
    if engine.async_scheduling:
        assert engine._in_flight is not None
    engine.abort_request([ids[1], ids[3]])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id in (ids[0], ids[2])
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def workload(engine: Engine):
    """Mixed sampling under preemption, prefix hits (multi-turn, and one prompt again at
    once: a hit even where the small pool evicts between turns), then an abort."""
    first = run_to_completion(engine, PROMPTS, PARAMS)
    turns = multi_turn(engine, num_conversations=3, num_turns=3, max_tokens=5)
    hits = engine.stats()["prefix_cache_hit_tokens"]
    again = [run_to_completion(engine, [PROMPTS[7]], greedy(3))[0] for _ in range(2)]
    assert engine.stats()["prefix_cache_hit_tokens"] > hits
    turns.append([(None, o) for o in again])
    survivors = abort_mid_run(engine)
    return first, [[o.outputs[0].token_ids for _, o in t] for t in turns], survivors


@pytest.fixture(scope="module")
def dense_path(tiny_model):
    return tiny_model("qwen2")  # 4 heads / 2 KV heads, QKV bias: exercises the shard paths


@pytest.fixture(scope="module", params=["dense", "qwen3_next"])
def reference(request, dense_path, hybrid_model):
    """The synchronous in-process engine's run of the workload."""
    path = dense_path if request.param == "dense" else hybrid_model(request.param)
    settings = SETTINGS[request.param]
    sync = make_engine(path, settings, async_scheduling=False)
    return path, settings, workload(sync), sync.stats()


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_async_over_ray_matches_the_synchronous_engine(local_ray, reference, tp):
    path, settings, (first, turns, survivors), sync_stats = reference
    eng = make_engine(
        path, settings, executor="ray", tensor_parallel_size=tp, async_scheduling=True
    )
    try:
        assert eng.async_scheduling
        got_first, got_turns, got_survivors = workload(eng)
        for want, got in zip(first, got_first, strict=True):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            assert got.outputs[0].finish_reason == want.outputs[0].finish_reason
            if tp == 1:  # one rank computes bit for bit what the in-process rank does
                assert got.outputs[0].logprobs == want.outputs[0].logprobs
        assert got_turns == turns
        assert got_survivors == survivors and len(survivors) == 2
        stats = eng.stats()
        assert stats["num_preemptions"] > 0 and sync_stats["num_preemptions"] > 0
        assert stats["prefix_cache_hit_tokens"] > 0
        assert_pool_full(eng)
        ex = eng.executor
        # Pipelined: most steps were read back because the next one was already out, not
        # because of a flush marker; and every result was claimed, in order.
        flushes = ex.publisher.num_published - ex._num_submitted
        assert 0 < flushes < ex._num_submitted / 2, (flushes, ex._num_submitted)
        assert ex._num_received == ex._num_submitted and not ex._unclaimed
    finally:
        eng.shutdown()


# Speculation with async scheduling over Ray: (model, method, tp) runs, each against the
# synchronous in-process engine with the same drafter.
SPEC_RUNS = [
    ("dense", "ngram", 1),
    ("dense", "ngram", 2),
    ("dense", "draft_model", 1),
    ("dense", "draft_model", 2),
    ("qwen3_next", "ngram", 2),
    ("qwen3_next", "draft_model", 1),
]


@pytest.fixture(scope="module")
def spec_references(dense_path, hybrid_model, tiny_model):
    """(model, method) -> (path, settings, the synchronous in-process run), made once."""
    cache = {}

    def get(model: str, method: str):
        if (model, method) not in cache:
            path = dense_path if model == "dense" else hybrid_model(model)
            if method == "ngram":
                spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
            else:
                draft = str(tiny_model("qwen3"))  # an unrelated draft: accepts and rejects
                spec = {"method": method, "draft_model": draft, "num_speculative_tokens": 3}
            # Pools that preempt and still keep hits between turns, with lookahead slots
            # (the unrelated draft's layers form groups of their own: twice the blocks).
            blocks = {"dense": 26, "qwen3_next": 40}[model] * (2 if method != "ngram" else 1)
            settings = SETTINGS[model] | dict(speculative_config=spec, num_kv_blocks=blocks)
            sync = make_engine(path, settings, async_scheduling=False)
            cache[model, method] = (path, settings, workload(sync), sync.stats())
        return cache[model, method]

    return get


@pytest.mark.parametrize(("model", "method", "tp"), SPEC_RUNS, ids=lambda v: str(v))
def test_async_speculation_over_ray_matches_the_synchronous_engine(
    local_ray, spec_references, model, method, tp
):
    """The step ahead carries placeholder drafts that every rank fills alike from its
    own proposals; tokens (and at TP 1 logprobs) are the synchronous engine's."""
    path, settings, (first, turns, survivors), sync_stats = spec_references(model, method)
    eng = make_engine(
        path, settings, executor="ray", tensor_parallel_size=tp, async_scheduling=True
    )
    try:
        assert eng.async_scheduling
        steps = []
        submit = eng.executor.submit
        eng.executor.submit = lambda sched: steps.append(sched) or submit(sched)
        got_first, got_turns, got_survivors = workload(eng)
        for want, got in zip(first, got_first, strict=True):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            assert got.outputs[0].finish_reason == want.outputs[0].finish_reason
            if tp == 1:
                assert got.outputs[0].logprobs == want.outputs[0].logprobs
        assert got_turns == turns
        assert got_survivors == survivors and len(survivors) == 2
        stats = eng.stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
        assert stats["spec_drafted_tokens"] > 0 and sync_stats["spec_drafted_tokens"] > 0
        placeholders = sum(any(-1 in d for d in s.scheduled_spec_token_ids.values()) for s in steps)
        assert placeholders > len(steps) / 5, (placeholders, len(steps))
        assert_pool_full(eng)
        ex = eng.executor
        assert ex._num_received == ex._num_submitted and not ex._unclaimed
    finally:
        eng.shutdown()


def test_killed_worker_fails_every_request_fast(local_ray, dense_path):
    eng = make_engine(
        dense_path,
        SETTINGS["dense"] | dict(num_kv_blocks=None),
        executor="ray",
        tensor_parallel_size=2,
        async_scheduling=True,
    )
    try:

        def a_step_is_in_flight():
            assert eng._in_flight is not None

        kill_worker_mid_run(eng, local_ray, before_kill=a_step_is_in_flight)
        assert eng._in_flight is None
        assert_pool_full(eng)
        with pytest.raises(RuntimeError, match="engine is down"):
            eng.add_request("late", {"prompt_token_ids": [5, 6]}, greedy(2))
    finally:
        eng.shutdown()


def test_default_is_on_for_cuda_only_drafter_or_not():
    def config(wanted, method=None):
        return SimpleNamespace(
            scheduler=SimpleNamespace(async_scheduling=wanted),
            speculative=SimpleNamespace(method=method),
        )

    ray_like = SimpleNamespace(submit=lambda sched: None, device_type="cuda")
    cpu = SimpleNamespace(submit=lambda sched: None, device_type="cpu")
    assert _use_async_scheduling(config(None), ray_like) is True
    assert _use_async_scheduling(config(None), cpu) is False
    assert _use_async_scheduling(config(True), cpu) is True
    assert _use_async_scheduling(config(False), ray_like) is False
    for method in ("ngram", "draft_model", "eagle"):
        assert _use_async_scheduling(config(None, method), ray_like) is True
        assert _use_async_scheduling(config(None, method), cpu) is False
        assert _use_async_scheduling(config(True, method), cpu) is True
        assert _use_async_scheduling(config(False, method), ray_like) is False
    with pytest.raises(ValueError, match="launches steps ahead"):
        _use_async_scheduling(config(True), SimpleNamespace(device_type="cpu"))


def test_a_refused_setting_leaves_no_workers_behind(local_ray, dense_path):
    """The refusal comes after the worker actors exist (the KV cache is sized from what
    they report): they and their placement group must be gone when the error reaches
    the caller."""
    with pytest.raises(ValueError, match="does not fit"):
        make_engine(
            dense_path,
            SETTINGS["dense"] | dict(num_kv_blocks=None),
            executor="ray",
            async_scheduling=True,
            kv_cache_memory_bytes=1,
        )
    table = local_ray.util.placement_group_table()
    assert [pg for pg in table.values() if pg["state"] != "REMOVED"] == []


def test_linear_state_checkpoints_of_two_steps_in_flight(hybrid_model):
    """Prefill chunks of one block each, every chunk a linear-state checkpoint (interval 16):
    the step scheduled ahead takes its checkpoint pages before the step in flight is
    published. All are published (the same hits as the synchronous engine: the prompt but
    its last token, from the end-of-prompt checkpoint) and none is leaked."""
    path = hybrid_model("qwen3_next")
    runs = []
    for mode in (False, True):
        eng = make_engine(
            path,
            SETTINGS["qwen3_next"],
            async_scheduling=mode,
            linear_state_checkpoint_interval=16,
        )
        outs = [run_to_completion(eng, [PROMPTS[7]], greedy(3))[0] for _ in range(2)]
        runs.append(([o.outputs[0].token_ids for o in outs], eng.stats()))
        assert_pool_full(eng)
    (sync_ids, sync_stats), (async_ids, async_stats) = runs
    assert async_ids == sync_ids
    hit = len(PROMPTS[7]) - 1
    assert async_stats["prefix_cache_hit_tokens"] == sync_stats["prefix_cache_hit_tokens"] == hit
    assert async_stats["linear_state_checkpoints_kept"] >= 3  # the interval ones too


def test_graph_blockers_name_why_graphs_stay_off(tiny_model, monkeypatch):
    """CUDA graphs stay off at TP > 1 and DCP > 1, each reason named, until
    KVLOOM_MULTI_RANK_CUDA_GRAPHS lifts both (a DCP shard's attention is the Triton kernel,
    capturable); a local drafter no longer blocks them (test_verification_graphs.py)."""
    eng = make_engine(tiny_model("llama"), SETTINGS["dense"])
    runner = eng.executor.worker.runner
    assert runner.graph_blockers() == ["not a CUDA device"] and runner._graph_sizes() == []
    runner.tp = SimpleNamespace(world_size=2)
    runner.dcp = SimpleNamespace(world_size=2)
    runner.draft = object()
    reasons = " | ".join(runner.graph_blockers())
    for what in ("tensor_parallel_size", "decode_context_parallel_size"):
        assert what in reasons
    assert "drafter" not in reasons
    # The switch for a multi-GPU run lifts the TP and DCP entries alike.
    monkeypatch.setenv("KVLOOM_MULTI_RANK_CUDA_GRAPHS", "1")
    assert runner.graph_blockers() == ["not a CUDA device"]
