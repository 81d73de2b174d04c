"""A request's tokens must not depend on what it is batched with, on chunk sizes or on
preemption (float64, so the comparison is exact)."""

from __future__ import annotations

import pytest

from kvloom import Engine
from tests.engine_helpers import PROMPTS, assert_pool_full, greedy, run_to_completion


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("llama"))


def make_engine(model_dir: str, **kwargs) -> Engine:
    kwargs.setdefault("dtype", "float64")
    kwargs.setdefault("block_size", 4)
    return Engine(model=model_dir, progress=False, **kwargs)


@pytest.fixture(scope="module")
def alone(model_dir):
    """Each prompt run by itself on a fresh engine."""
    return [
        run_to_completion(make_engine(model_dir), [p], greedy(24))[0].outputs[0].token_ids
        for p in PROMPTS
    ]


@pytest.mark.parametrize("budget", [5, 64, 4096])
def test_batched_equals_alone_under_token_budgets(model_dir, alone, budget):
    engine = make_engine(model_dir, max_num_batched_tokens=budget)
    outs = run_to_completion(engine, PROMPTS, greedy(24))
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert_pool_full(engine)


def test_long_prefill_threshold_chunks_give_same_tokens(model_dir, alone):
    engine = make_engine(model_dir, long_prefill_token_threshold=3)
    outs = run_to_completion(engine, PROMPTS, greedy(24))
    assert [o.outputs[0].token_ids for o in outs] == alone


def test_preemption_gives_same_tokens(model_dir, alone):
    # 8 requests of up to 74 tokens in blocks of 4 need ~100 blocks; 30 forces preemption.
    engine = make_engine(model_dir, num_kv_blocks=30, enable_prefix_caching=False)
    outs = run_to_completion(engine, PROMPTS, greedy(24))
    assert engine.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert_pool_full(engine)


def test_preemption_with_prefix_caching_gives_same_tokens(model_dir, alone):
    engine = make_engine(model_dir, num_kv_blocks=30, max_num_batched_tokens=16)
    outs = run_to_completion(engine, PROMPTS, greedy(24))
    assert engine.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert_pool_full(engine)
