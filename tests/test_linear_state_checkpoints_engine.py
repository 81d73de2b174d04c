"""Hybrid prefix caching at any prompt length, end to end (issue 17): at the default block
size, multi-turn conversations of 60-1500-token prompts hit at least 90% of the previous
turn's prompt + output on every later turn, with outputs identical to caching off; parallel
requests sharing a system prompt hit it after one warm request."""

from __future__ import annotations

import random

import pytest

from kvloom import Engine, SamplingParams
from tests.engine_helpers import assert_pool_full, run_to_completion

VOCAB = 512


@pytest.fixture(scope="module")
def qwen3_next_real_widths(hybrid_model, tmp_path_factory):
    """Qwen3-Next with Gated DeltaNet at its released widths (16 key heads and 32 value
    heads of 128, a 4-tap conv) in few layers (3 GDN + 1 attention), a small hidden size
    and vocabulary, float32 random weights (std 0.1 so greedy margins are real): the
    checkpoint benchmarks/hybrid_gdn_widths_model.py writes."""
    from benchmarks.hybrid_gdn_widths_model import write_model

    out = tmp_path_factory.mktemp("qwen3-next-gdn-widths")
    return write_model(out, hybrid_model("qwen3_next"), vocab_size=VOCAB)


def engine(path, caching: bool, **kw) -> Engine:
    return Engine(
        model=str(path),
        dtype="float32",
        progress=False,
        enable_prefix_caching=caching,
        max_num_batched_tokens=2048,
        **kw,
    )


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy, with each sampled token's logprob (compared too: a wrong cached value can
    shift logits without changing a tiny model's greedy tokens)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)


def assert_same_outputs(got, want, tol: float) -> None:
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for a, b in zip(got, want):
        la = [lp[t].logprob for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
        lb = [lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
        assert la == pytest.approx(lb, abs=tol), (a.request_id, la, lb)


def conversations(rng, starts):
    return [[5 + rng.randrange(VOCAB - 10) for _ in range(n)] for n in starts]


def run_turns(eng: Engine, seed: int, starts, additions, max_tokens: int = 4):
    """Interleaved conversations: turn k's prompt is turn k-1's prompt + output + new user
    text (`additions[k-1]` tokens). Returns, per turn, (prompt, output) per conversation."""
    rng = random.Random(seed)
    prompts = conversations(rng, starts)
    turns = []
    for turn in range(len(additions) + 1):
        outs = run_to_completion(eng, prompts, greedy(max_tokens))
        turns.append(list(zip(prompts, outs)))
        if turn < len(additions):
            prompts = [
                p + o.outputs[0].token_ids + conversations(rng, [additions[turn]])[0]
                for p, o in zip(prompts, outs)
            ]
    return turns


# Two conversations, 60 and 130 tokens at first, about 1500 tokens by the third turn.
STARTS = [60, 130]
ADDITIONS = [600, 700]


@pytest.mark.parametrize("model", ["qwen3_next_real_widths", "kimi_linear"])
def test_multi_turn_hits_the_previous_turn_at_the_default_block_size(request, hybrid_model, model):
    path = request.getfixturevalue(model) if model != "kimi_linear" else hybrid_model("kimi_linear")
    cached_engine = engine(path, True, sanitize=True)
    assert cached_engine.stats()["block_size"] == 16  # the default, hybrids included
    cached = run_turns(cached_engine, 0, STARTS, ADDITIONS)
    plain = run_turns(engine(path, False, sanitize=True), 0, STARTS, ADDITIONS)
    lengths = [len(p) for turn in cached for p, _ in turn]
    assert min(lengths) == 60 and max(lengths) >= 1400, lengths
    for turn_cached, turn_plain in zip(cached, plain):
        assert_same_outputs([o for _, o in turn_cached], [o for _, o in turn_plain], 1e-4)
    for turn in range(1, len(cached)):
        for (prev_prompt, prev_out), (_, out) in zip(cached[turn - 1], cached[turn]):
            previous = len(prev_prompt) + len(prev_out.outputs[0].token_ids)
            assert out.num_cached_tokens >= 0.9 * previous, (turn, out.num_cached_tokens, previous)
    stats = cached_engine.stats()
    assert stats["linear_state_checkpoints_hit"] >= len(STARTS) * len(ADDITIONS)
    assert stats["linear_state_checkpoints_kept"] > 0
    assert stats["linear_state_checkpoint_bytes"] > 0
    assert_pool_full(cached_engine)


def test_parallel_requests_hit_a_shared_system_prompt(hybrid_model):
    """One warm request carries the system prompt (its prefill leaves a checkpoint one
    token before the prompt's end, the longest hit a repeat of it can take); then 16
    parallel requests, each the system prompt + its own question, all hit it but its last
    token."""
    path = hybrid_model("qwen3_next")
    rng = random.Random(1)
    system = conversations(rng, [75])[0]
    questions = conversations(rng, [rng.randint(5, 30) for _ in range(16)])
    cached_engine = Engine(model=str(path), dtype="float64", progress=False, sanitize=True)
    warm = run_to_completion(cached_engine, [system], greedy(3))[0]
    assert warm.num_cached_tokens == 0
    prompts = [system + q for q in questions]
    outs = run_to_completion(cached_engine, prompts, greedy(5))
    assert [o.num_cached_tokens for o in outs] == [len(system) - 1] * 16
    plain = Engine(model=str(path), dtype="float64", progress=False, enable_prefix_caching=False)
    expected = run_to_completion(plain, prompts, greedy(5))
    assert_same_outputs(outs, expected, 1e-9)
    assert_pool_full(cached_engine)


@pytest.mark.parametrize("arch", ["qwen3_next", "kimi_linear"])
def test_checkpoints_evicted_under_pressure_are_never_served(hybrid_model, arch):
    """A pool too small to keep every conversation's checkpoint: checkpoints and blocks are
    evicted and their pages reused (sanitizer on: a stale read is NaN), outputs still equal
    caching off."""
    path = hybrid_model(arch)
    kw = dict(dtype="float64", progress=False, sanitize=True, num_kv_blocks=90)
    cached_engine = Engine(model=str(path), **kw)
    starts, additions = [9, 14, 20, 25, 31, 40], [7, 12]
    cached = run_turns(cached_engine, 2, starts, additions, max_tokens=8)
    plain_engine = Engine(model=str(path), enable_prefix_caching=False, **kw)
    plain = run_turns(plain_engine, 2, starts, additions, max_tokens=8)
    assert_same_outputs([o for t in cached for _, o in t], [o for t in plain for _, o in t], 1e-9)
    stats = cached_engine.stats()
    assert stats["linear_state_checkpoints_evicted"] > 0, stats
    assert stats["linear_state_checkpoints_hit"] > 0, stats
    assert_pool_full(cached_engine)
