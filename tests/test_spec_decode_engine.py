"""Speculative decoding through the engine: lossless against plain decoding (greedy and
seeded sampling), with prefix caching, chunked prefill and preemption in the mix, on dense
and hybrid models (hybrids restore their linear state when a draft is rejected)."""

from __future__ import annotations

import random

import pytest

from kvloom import Engine, SamplingParams
from kvloom.workers.model_runner import ModelRunner
from kvloom.workers.row_kinds import RowKind
from tests.engine_helpers import assert_pool_full, greedy, run_to_completion

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def repetitive_prompts(n: int = 6) -> list[list[int]]:
    rng = random.Random(0)
    return [([5 + rng.randrange(40) for _ in range(6)] * 5)[: 20 + i] for i in range(n)]


@pytest.fixture(scope="module", params=["dense", "qwen3_next", "kimi_linear"])
def model_path(request, tiny_model, hybrid_model):
    return tiny_model("qwen3") if request.param == "dense" else hybrid_model(request.param)


POOL_SCALE = {"qwen3_next": 2.5, "kimi_linear": 3}


def engine(path, **kw) -> Engine:
    kw.setdefault("block_size", 4)
    if kw.get("num_kv_blocks") and kw["block_size"] == 4:
        # A hybrid's recurrent states span several 4-token pages each (6 for the tiny
        # Qwen3-Next, 10 for Kimi-Linear: docs/kv_cache_pages.md); these many more pages
        # keep about the pressure the pool sizes here were chosen for.
        scale = next((f for arch, f in POOL_SCALE.items() if f"hybrid-{arch}" in str(path)), 1)
        kw["num_kv_blocks"] = int(kw["num_kv_blocks"] * scale)
    return Engine(model=str(path), dtype="float64", progress=False, **kw)


@pytest.mark.parametrize(
    "setting",
    [dict(), dict(max_num_batched_tokens=7), dict(num_kv_blocks=30, max_num_batched_tokens=16)],
    ids=["plain", "chunked", "preempted"],
)
def test_ngram_greedy_is_lossless(model_path, setting):
    prompts = repetitive_prompts()
    expected = run_to_completion(engine(model_path), prompts, greedy(40))
    spec = engine(model_path, speculative_config=NGRAM, **setting)
    outs = run_to_completion(spec, prompts, greedy(40))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    stats = spec.stats()
    assert stats["spec_drafted_tokens"] > 0
    if "num_kv_blocks" in setting:
        assert stats["num_preemptions"] > 0
    assert_pool_full(spec)


def test_ngram_seeded_sampling_is_lossless(model_path):
    prompts = repetitive_prompts(4)
    params = [
        SamplingParams(max_tokens=30, temperature=0.7, top_k=20, seed=11 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    expected = run_to_completion(engine(model_path), prompts, params)
    outs = run_to_completion(engine(model_path, speculative_config=NGRAM), prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]


def test_acceptance_and_rejection_both_happen_and_stats_add_up(hybrid_model):
    """On the Qwen3-Next demo model the n-gram drafts are partly accepted: both the
    accept path and the restore-and-recompute path run."""
    spec = engine(hybrid_model("qwen3_next"), speculative_config=NGRAM)
    outs = run_to_completion(spec, repetitive_prompts(), greedy(40))
    stats = spec.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"]
    per_request = [o.metrics for o in outs if "spec_drafted_tokens" in o.metrics]
    assert sum(m["spec_drafted_tokens"] for m in per_request) == stats["spec_drafted_tokens"]
    assert sum(m["spec_accepted_tokens"] for m in per_request) == stats["spec_accepted_tokens"]
    assert stats["spec_mean_accepted_length"] > 1


def test_prompt_chunk_shaped_like_speculative_decodes_is_not_a_decode(tiny_model, monkeypatch):
    """A fresh prompt chunk of 1 + k tokens scheduled beside speculative decodes of 1 + k
    tokens is classified fresh, and the step is not a uniform decode."""
    seen = []
    original = ModelRunner.build_batch

    def recording(self, sched):
        input_ids, batch, rows = original(self, sched)
        seen.append((dict(sched.num_scheduled_tokens), batch.rows))
        return input_ids, batch, rows

    monkeypatch.setattr(ModelRunner, "build_batch", recording)
    spec = engine(
        tiny_model("qwen3"),
        speculative_config={"method": "ngram", "num_speculative_tokens": 1},
        max_num_batched_tokens=64,
    )
    for i, prompt in enumerate(repetitive_prompts(2)):
        spec.add_request(f"r{i}", {"prompt_token_ids": prompt}, greedy(30))
    spec.step()  # both prompts prefilled: they decode from now on
    for request in spec.scheduler.running:
        request.spec_token_ids = [11]  # one draft each, whatever the proposer found
    spec.add_request("fresh", {"prompt_token_ids": [7, 9]}, greedy(3))
    spec.step()
    scheduled, rows = seen[-1]
    assert scheduled == {"r0": 2, "r1": 2, "fresh": 2}
    assert [rows.kinds[i] for i in range(3)] == [RowKind.RESUME, RowKind.RESUME, RowKind.FRESH]
    assert not rows.uniform_decode(2)
    while spec.has_unfinished_requests():
        spec.step()
    assert_pool_full(spec)


def draft_config(path, k: int = 3) -> dict:
    return {"method": "draft_model", "draft_model": str(path), "num_speculative_tokens": k}


@pytest.mark.parametrize("chunked_preempted", [False, True], ids=["plain", "chunked-preempted"])
def test_target_as_its_own_draft_accepts_everything_losslessly(model_path, chunked_preempted):
    """Dense and hybrid targets drafting for themselves: every draft is accepted (a hybrid
    draft catches up only over accepted tokens and restores its state after proposing)."""
    setting = dict(num_kv_blocks=34, max_num_batched_tokens=16) if chunked_preempted else {}
    prompts = repetitive_prompts()
    expected = run_to_completion(engine(model_path), prompts, greedy(30))
    spec = engine(model_path, speculative_config=draft_config(model_path), **setting)
    outs = run_to_completion(spec, prompts, greedy(30))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    stats = spec.stats()
    assert stats["spec_drafted_tokens"] > 0
    assert stats["spec_accepted_tokens"] == stats["spec_drafted_tokens"]
    assert stats["spec_mean_accepted_length"] > 3  # k = 3: up to 4 tokens a step
    if chunked_preempted:
        assert stats["num_preemptions"] > 0
    assert_pool_full(spec)


def test_self_draft_keeps_prefix_hits_exact(hybrid_model):
    """Multi-turn with a hybrid self-draft: state checkpoints are taken after the draft has
    caught up, so hits restore both models' states and every draft is still accepted."""
    from tests.engine_helpers import multi_turn

    path = hybrid_model("qwen3_next")
    spec = engine(path, speculative_config=draft_config(path))
    turns = multi_turn(spec)
    assert [[o.outputs[0].token_ids for _, o in t] for t in turns] == [
        [o.outputs[0].token_ids for _, o in t] for t in multi_turn(engine(path))
    ]
    stats = spec.stats()
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["spec_accepted_tokens"] == stats["spec_drafted_tokens"] > 0


@pytest.mark.parametrize("target", ["dense", "qwen3_next"])
def test_unrelated_draft_model_is_rejected_losslessly(tiny_model, hybrid_model, target):
    target_path = tiny_model("qwen2") if target == "dense" else hybrid_model("qwen3_next")
    draft_path = tiny_model("qwen3")  # a different random model, same tokenizer
    prompts = repetitive_prompts()
    expected = run_to_completion(engine(target_path), prompts, greedy(30))
    spec = engine(
        target_path,
        speculative_config=draft_config(draft_path),
        num_kv_blocks=60,
        max_num_batched_tokens=16,
    )
    outs = run_to_completion(spec, prompts, greedy(30))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    stats = spec.stats()
    assert stats["spec_drafted_tokens"] > stats["spec_accepted_tokens"]
    assert stats["num_preemptions"] > 0
    assert_pool_full(spec)


def test_bad_speculative_config_names_the_field(tiny_model):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        engine(
            tiny_model("qwen2"), speculative_config={"method": "ngram", "num_speculative_tokens": 0}
        )
    with pytest.raises(ValueError, match="speculative_config.method"):
        engine(tiny_model("qwen2"), speculative_config={"method": "eagle9"})
    with pytest.raises(ValueError, match="speculative_config.model"):
        engine(
            tiny_model("qwen2"),
            speculative_config={"method": "draft_model", "num_speculative_tokens": 2},
        )


@pytest.mark.parametrize("window", [None, 8], ids=["full-head", "all-sliding-head"])
@pytest.mark.parametrize("target", ["dense", "qwen3_next"])
def test_eagle_head_is_lossless_with_prefix_caching(
    tiny_model, hybrid_model, tmp_path, target, window
):
    """A random EAGLE-style head (fed the target's hidden states) drafts; verification keeps
    the output exact, with chunked prefill, preemption and prefix hits across turns. An
    all-sliding-window head is booked as full attention for caching (invariant 4)."""
    from kvloom.workers.spec_decode.eagle import write_eagle_head
    from tests.engine_helpers import multi_turn

    target_path = tiny_model("qwen2") if target == "dense" else hybrid_model("qwen3_next")
    head = write_eagle_head(tmp_path / "head", target_path, sliding_window=window)
    plain = engine(target_path)
    spec = engine(
        target_path,
        speculative_config={
            "method": "eagle",
            "draft_model": str(head),
            "num_speculative_tokens": 3,
        },
        num_kv_blocks=80,
        max_num_batched_tokens=16,
    )
    prompts = repetitive_prompts()
    expected = run_to_completion(plain, prompts, greedy(30))
    outs = run_to_completion(spec, prompts, greedy(30))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    turns = multi_turn(spec)
    assert [[o.outputs[0].token_ids for _, o in t] for t in turns] == [
        [o.outputs[0].token_ids for _, o in t] for t in multi_turn(plain)
    ]
    stats = spec.stats()
    assert stats["spec_drafted_tokens"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    kinds = {type(g.spec).__name__ for g in spec.kv_cache.groups}
    assert "SlidingWindowSpec" not in kinds  # the all-sliding head is booked as full
    assert_pool_full(spec)


# -- speculation with async scheduling -------------------------------------------------
# The step scheduled ahead gets placeholder draft slots; the worker fills them from the
# drafts it proposed in the step still in flight and corrects the positions by what that
# step rejected. Tokens must be the synchronous engine's, exactly (float64).

ASYNC_PARAMS = [
    greedy(24),
    SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=18, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
    SamplingParams(max_tokens=3, temperature=0.0),
    SamplingParams(max_tokens=22, temperature=1.0, seed=5, logprobs=2, ignore_eos=True),
    greedy(24),
]


def record_steps(eng: Engine) -> list:
    """The SchedulerOutputs the engine launches, in order (wraps the executor's submit)."""
    seen = []
    submit = eng.executor.submit

    def recording(sched):
        seen.append(sched)
        return submit(sched)

    eng.executor.submit = recording
    return seen


def placeholder_steps(steps) -> int:
    from kvloom.contracts.scheduler_output import PLACEHOLDER_TOKEN_ID

    return sum(
        any(PLACEHOLDER_TOKEN_ID in drafts for drafts in s.scheduled_spec_token_ids.values())
        for s in steps
    )


def abort_two_in_flight(eng: Engine) -> dict[str, list[int]]:
    """Four requests; two are aborted after two steps (with async, one is in flight)."""
    prompts = repetitive_prompts(4)
    for i, prompt in enumerate(prompts):
        eng.add_request(f"ab{i}", {"prompt_token_ids": prompt}, greedy(16))
    eng.step()
    eng.step()
    if eng.async_scheduling:
        assert eng._in_flight is not None
    eng.abort_request(["ab1", "ab3"])
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id in ("ab0", "ab2")
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def spec_workload(eng: Engine):
    """Mixed sampling (greedy, seeded, penalties, logprobs) under a small pool, multi-turn
    prefix hits, then an abort with a step in flight."""
    from tests.engine_helpers import multi_turn

    first = run_to_completion(eng, repetitive_prompts(), ASYNC_PARAMS)
    turns = multi_turn(eng, num_conversations=2, num_turns=3, max_tokens=8)
    # One long prompt twice in a row: a hit even where the small pool evicts between turns.
    again = [run_to_completion(eng, [repetitive_prompts(8)[7] * 2], greedy(6))[0] for _ in "ab"]
    turns.append([(None, o) for o in again])
    survivors = abort_two_in_flight(eng)
    return (
        [
            (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs)
            for o in first
        ],
        [[o.outputs[0].token_ids for _, o in t] for t in turns],
        survivors,
    )


@pytest.fixture(scope="module", params=["dense", "qwen3_next"])
def async_target(request, tiny_model, hybrid_model):
    return tiny_model("qwen3") if request.param == "dense" else hybrid_model("qwen3_next")


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_async_speculation_matches_the_synchronous_engine(async_target, tiny_model, method):
    spec = NGRAM if method == "ngram" else draft_config(tiny_model("qwen2"))
    hybrid = "qwen3_next" in str(async_target)
    setting = dict(
        speculative_config=spec,
        block_size=16 if hybrid else 4,
        num_kv_blocks=40 if hybrid else 48,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        device="cpu",
    )
    sync = engine(async_target, async_scheduling=False, **setting)
    assert not sync.async_scheduling
    want = spec_workload(sync)
    eng = engine(async_target, async_scheduling=True, **setting)
    steps = record_steps(eng)
    got = spec_workload(eng)
    assert got == want
    stats, sync_stats = eng.stats(), sync.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert stats["spec_drafted_tokens"] > 0
    assert placeholder_steps(steps) > len(steps) / 4, (placeholder_steps(steps), len(steps))
    assert sync_stats["spec_drafted_tokens"] > 0
    assert_pool_full(eng)


def test_async_self_draft_still_accepts_every_draft(tiny_model):
    """A dense target drafting for itself, greedy: the drafts the worker puts into the
    placeholder slots are the real ones, so every draft is accepted, as synchronously."""
    path = tiny_model("qwen3")
    eng = engine(path, speculative_config=draft_config(path), async_scheduling=True, device="cpu")
    steps = record_steps(eng)
    outs = run_to_completion(eng, repetitive_prompts(), greedy(30))
    want = run_to_completion(engine(path), repetitive_prompts(), greedy(30))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    stats = eng.stats()
    assert stats["spec_accepted_tokens"] == stats["spec_drafted_tokens"] > 0
    assert stats["spec_mean_accepted_length"] > 3
    assert placeholder_steps(steps) > len(steps) / 2
    assert_pool_full(eng)


def test_async_eagle_head_matches_the_synchronous_engine(tiny_model, tmp_path):
    from kvloom.workers.spec_decode.eagle import write_eagle_head

    target = tiny_model("qwen2")
    head = write_eagle_head(tmp_path / "head", target)
    spec = {"method": "eagle", "draft_model": str(head), "num_speculative_tokens": 3}
    setting = dict(speculative_config=spec, num_kv_blocks=60, max_num_batched_tokens=16)
    want = spec_workload(engine(target, async_scheduling=False, **setting))
    eng = engine(target, async_scheduling=True, device="cpu", **setting)
    assert spec_workload(eng) == want
    assert eng.stats()["spec_drafted_tokens"] > 0
    assert_pool_full(eng)


def test_placeholder_slots_the_worker_cannot_fill_count_as_rejected(tiny_model):
    """No n-gram recurs in these prompts: the worker has no drafts for the placeholder
    slots, runs the rows without them and reports so; the scheduler takes the slots back
    (no drafts counted) and the tokens are the plain engine's."""
    path = tiny_model("qwen3")
    prompts = [list(range(5 + 30 * i, 25 + 30 * i)) for i in range(3)]
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3}
    eng = engine(path, speculative_config=spec, async_scheduling=True, device="cpu")
    steps = record_steps(eng)
    outs = run_to_completion(eng, prompts, greedy(6))
    want = run_to_completion(engine(path), prompts, greedy(6))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    assert placeholder_steps(steps) > 0
    assert eng.stats()["spec_drafted_tokens"] == 0
    assert_pool_full(eng)


def test_speculative_config_takes_vllms_model_key(tiny_model):
    """`model` is vLLM's key for the drafter's directory; `draft_model` stays an alias."""
    from kvloom.contracts.config import SpeculativeConfig

    path = tiny_model("qwen2")
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=2, model=path)
    assert spec.model == spec.draft_model == str(path)
    with pytest.raises(ValueError, match="speculative_config.model"):
        SpeculativeConfig(method="eagle", num_speculative_tokens=2, model=path, draft_model="/x")
    with pytest.raises(ValueError, match="speculative_config.placement"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, placement="moon")
