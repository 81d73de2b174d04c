"""Blocks return to the pool after every finish and every abort."""

from __future__ import annotations

import random

from kvloom import Engine, SamplingParams
from tests.engine_helpers import PROMPTS, assert_pool_full, greedy


def test_pool_full_after_random_aborts(tiny_model):
    engine = Engine(model=str(tiny_model("llama")), progress=False, block_size=4, num_kv_blocks=60)
    rng = random.Random(0)
    live: set[str] = set()
    for round_ in range(6):
        for i, prompt in enumerate(PROMPTS):
            rid = f"r{round_}-{i}"
            engine.add_request(rid, {"prompt_token_ids": prompt}, greedy(rng.randint(1, 20)))
            live.add(rid)
        for _ in range(rng.randint(1, 12)):
            for out in engine.step():
                if out.finished:
                    live.discard(out.request_id)
        for rid in rng.sample(sorted(live), k=len(live) // 2):
            engine.abort_request(rid)
            live.discard(rid)
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_full(engine)
    assert engine.stats()["num_aborted"] > 0


def test_abort_of_unknown_or_finished_request_is_harmless(tiny_model):
    engine = Engine(model=str(tiny_model("llama")), progress=False)
    assert engine.abort_request("never-added") == []
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.abort_request("a") == []
    assert_pool_full(engine)


def test_abort_returns_each_live_requests_final_output(tiny_model):
    engine = Engine(model=str(tiny_model("llama")), progress=False)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    engine.add_request("run", {"prompt_token_ids": [5, 6, 7]}, params)
    engine.step()
    engine.add_request("wait", {"prompt_token_ids": [8, 9]}, params)
    finals = engine.abort_request(["run", "wait", "unknown"])
    assert [o.request_id for o in finals] == ["run", "wait"]
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in finals)
    assert len(finals[0].outputs[0].token_ids) >= 1 and finals[1].outputs[0].token_ids == []
    assert not engine.has_unfinished_requests()
    assert_pool_full(engine)
