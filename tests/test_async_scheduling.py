"""Async scheduling: step N+1 is scheduled and launched before step N's tokens are read
back (its inputs come from N's sampled ids on the device). Outputs must be exactly those of
the synchronous engine, whatever finishes, stops, preempts or aborts while a step is in
flight, and every block must return to the pool (float64 on CPU: exact comparisons)."""

from __future__ import annotations

import pytest

from kvloom import Engine, SamplingParams
from tests.engine_helpers import (
    PROMPTS,
    assert_pool_full,
    greedy,
    multi_turn,
    run_to_completion,
)


def make_engine(path, async_scheduling: bool, **kwargs) -> Engine:
    kwargs.setdefault("dtype", "float64")
    kwargs.setdefault("block_size", 4)
    return Engine(
        model=str(path), progress=False, device="cpu", async_scheduling=async_scheduling, **kwargs
    )


def both(path, prompts, params, **kwargs):
    """(sync outputs, async outputs, the async engine)."""
    sync = run_to_completion(make_engine(path, False, **kwargs), prompts, params)
    engine = make_engine(path, True, **kwargs)
    assert engine.async_scheduling
    outs = run_to_completion(engine, prompts, params)
    return sync, outs, engine


def same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert y.outputs[0].token_ids == x.outputs[0].token_ids
        assert y.outputs[0].text == x.outputs[0].text
        assert y.outputs[0].finish_reason == x.outputs[0].finish_reason
        assert y.outputs[0].stop_reason == x.outputs[0].stop_reason


@pytest.fixture(params=["llama", "qwen3_next"])
def model(request, tiny_model, hybrid_model):
    return tiny_model("llama") if request.param == "llama" else hybrid_model("qwen3_next")


def test_greedy_outputs_match_the_synchronous_engine(model):
    sync, outs, engine = both(model, PROMPTS, greedy(20))
    same(sync, outs)
    assert_pool_full(engine)


def test_runs_ahead_only_by_one_step(tiny_model):
    engine = make_engine(tiny_model("llama"), True)
    engine.add_request("a", {"prompt_token_ids": PROMPTS[3]}, greedy(6))
    engine.step()
    assert engine._in_flight is not None  # the second step was launched before the first read
    request = engine.scheduler.requests["a"]
    assert request.num_pending_output_tokens == 1
    assert request.num_computed_tokens == len(PROMPTS[3]) + 1


def test_varied_lengths_stops_and_sampling(model):
    params = [
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.7, top_k=20, logprobs=2),
        SamplingParams(max_tokens=16, temperature=0.0, min_tokens=4),
        SamplingParams(max_tokens=30, temperature=1.0, seed=11),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, logprobs=0),
        SamplingParams(max_tokens=20, temperature=0.0),
    ]
    sync, outs, engine = both(model, PROMPTS, params)
    same(sync, outs)
    for x, y in zip(sync, outs):
        if x.outputs[0].logprobs is not None:
            assert y.outputs[0].logprobs == x.outputs[0].logprobs
    assert_pool_full(engine)


def test_stop_tokens_and_strings_end_requests_in_flight(tiny_model):
    """A stop found when a step is read back ends the request although the next step
    already computed a token for it: that token is dropped, its blocks still return."""
    path = tiny_model("llama")
    free = run_to_completion(make_engine(path, False), PROMPTS, greedy(12))
    stop_ids = [[o.outputs[0].token_ids[5]] for o in free]
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=s, ignore_eos=True)
        for s in stop_ids
    ]
    sync, outs, engine = both(path, PROMPTS, params)
    same(sync, outs)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert_pool_full(engine)
    texts = [o.outputs[0].text for o in free]
    stops = [t[len(t) // 2 : len(t) // 2 + 2] for t in texts if len(t) > 4]
    params = SamplingParams(max_tokens=12, temperature=0.0, stop=stops[:3], ignore_eos=True)
    sync, outs, engine = both(path, PROMPTS, params)
    same(sync, outs)
    assert any(o.outputs[0].finish_reason == "stop" for o in outs)
    assert_pool_full(engine)


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_while_a_step_is_in_flight(model, caching):
    kwargs = dict(num_kv_blocks=40, max_num_batched_tokens=16, enable_prefix_caching=caching)
    if "qwen3_next" in str(model):
        kwargs.update(block_size=16, num_kv_blocks=20)
    sync, outs, engine = both(model, PROMPTS, greedy(24), **kwargs)
    assert engine.stats()["num_preemptions"] > 0
    same(sync, outs)
    assert_pool_full(engine)


def test_prefix_cache_multi_turn(model):
    runs = []
    for mode in (False, True):
        engine = make_engine(model, mode, enable_prefix_caching=True)
        turns = multi_turn(engine, num_conversations=3, num_turns=3)
        runs.append([[o.outputs[0].token_ids for _, o in turn] for turn in turns])
        assert engine.stats()["prefix_cache_hit_tokens"] > 0
        assert_pool_full(engine)
    assert runs[0] == runs[1]


def test_abort_with_a_step_in_flight(tiny_model):
    engine = make_engine(tiny_model("llama"), True)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, greedy(30))
    engine.step()
    engine.step()
    assert engine._in_flight is not None
    engine.abort_request(["1", "3"])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id in ("0", "2")
            if out.finished:
                done[out.request_id] = out
    want = run_to_completion(make_engine(tiny_model("llama"), False), [PROMPTS[0]], greedy(30))
    assert done["0"].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert_pool_full(engine)


def test_penalties_count_the_token_still_on_the_device(model):
    """Penalties read the token history; the newest token is still on the device when the
    step was scheduled ahead, and counts from there."""
    params = [
        SamplingParams(max_tokens=14, temperature=0.0, repetition_penalty=1.3),
        SamplingParams(max_tokens=14, temperature=0.0, presence_penalty=1.5),
        SamplingParams(max_tokens=14, temperature=0.0, frequency_penalty=1.2, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=0.8, seed=2, repetition_penalty=0.7),
        SamplingParams(max_tokens=14, temperature=0.0, min_tokens=6, frequency_penalty=-1.0),
    ]
    sync, outs, engine = both(model, PROMPTS[:5], params)
    same(sync, outs)
    plain = run_to_completion(make_engine(model, True), PROMPTS[:5], greedy(14))
    assert [o.outputs[0].token_ids for o in plain] != [o.outputs[0].token_ids for o in outs]
    assert_pool_full(engine)


def test_reused_request_id_after_finish(tiny_model):
    engine = make_engine(tiny_model("llama"), True)
    first = run_to_completion(engine, [PROMPTS[2]], greedy(5))
    engine.add_request("x", {"prompt_token_ids": PROMPTS[1]}, greedy(4))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    engine.add_request("x", {"prompt_token_ids": PROMPTS[3]}, greedy(4))
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    want = run_to_completion(make_engine(tiny_model("llama"), False), [PROMPTS[3]], greedy(4))
    assert first[0].outputs[0].token_ids
    assert outs[-1].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert_pool_full(engine)


def test_a_bad_async_scheduling_value_is_refused(tiny_model):
    with pytest.raises(ValueError, match="async_scheduling"):
        make_engine(tiny_model("llama"), "yes")


def test_runs_ahead_with_placeholder_drafts(tiny_model):
    """With speculation the step scheduled ahead reserves placeholder draft slots; the
    scheduler counts them as computed and pending (all accepted, the longest case) until
    the step in flight comes back."""
    from kvloom.contracts.scheduler_output import PLACEHOLDER_TOKEN_ID

    spec = {"method": "ngram", "num_speculative_tokens": 2}
    engine = make_engine(tiny_model("llama"), True, speculative_config=spec)
    prompt = PROMPTS[3]
    engine.add_request("a", {"prompt_token_ids": prompt}, greedy(6))
    engine.step()  # the prefill is read back; the first decode was launched before that
    sched, _ = engine._in_flight
    assert sched.num_scheduled_tokens == {"a": 3}
    assert sched.scheduled_spec_token_ids == {"a": [PLACEHOLDER_TOKEN_ID] * 2}
    request = engine.scheduler.requests["a"]
    assert request.num_output_tokens == 1
    assert request.num_computed_tokens == len(prompt) + 3
    assert request.num_pending_output_tokens == 3  # the decode's token and both drafts
    want = run_to_completion(make_engine(tiny_model("llama"), False), [prompt], greedy(6))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert outs[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert_pool_full(engine)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_gpu_async_scheduling_is_on_and_matches_sync(tiny_model, hybrid_model, arch):
    path = hybrid_model(arch) if arch == "qwen3_next" else tiny_model(arch)
    params = [
        greedy(16),
        SamplingParams(max_tokens=12, temperature=0.8, seed=5),
        SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3),
        SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=1.0, min_tokens=4),
    ] * 2
    runs = []
    for mode in (None, False):
        engine = Engine(model=str(path), dtype="float32", device="cuda", async_scheduling=mode)
        assert engine.async_scheduling is (mode is None)
        runs.append(run_to_completion(engine, PROMPTS, params))
        assert_pool_full(engine)
    same(runs[1], runs[0])
