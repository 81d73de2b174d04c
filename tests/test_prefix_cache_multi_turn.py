"""Prefix caching on a multi-turn workload: outputs identical with caching on and off,
and turns >= 2 hit at least 90% of the reusable prefix."""

from __future__ import annotations

import pytest

from kvloom import Engine
from tests.engine_helpers import assert_pool_full, multi_turn, reusable_prefix

BLOCK = 4
MODELS = {
    "dense": ("llama", {}),
    "sliding": ("mistral", {"sliding_window": 8}),
    "interleaved": (
        "qwen3",
        {
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 8,
            "use_sliding_window": True,
        },
    ),
}


def engine_for(path, caching: bool, **kw) -> Engine:
    return Engine(
        model=str(path),
        dtype="float64",
        progress=False,
        block_size=BLOCK,
        enable_prefix_caching=caching,
        **kw,
    )


HYBRIDS = ["qwen3_next", "kimi_linear"]


@pytest.mark.parametrize("kind", list(MODELS) + HYBRIDS)
def test_multi_turn_same_outputs_and_high_hit_rate(tiny_model, hybrid_model, kind):
    if kind in HYBRIDS:
        path = hybrid_model(kind)
    else:
        arch, overrides = MODELS[kind]
        path = tiny_model(arch, **overrides)
    cached_engine = engine_for(path, True)
    cached = multi_turn(cached_engine)
    plain = multi_turn(engine_for(path, False))
    for turn_cached, turn_plain in zip(cached, plain):
        assert [o.outputs[0].token_ids for _, o in turn_cached] == [
            o.outputs[0].token_ids for _, o in turn_plain
        ]
    for turn in range(1, len(cached)):
        reusable = reusable_prefix(cached, turn, BLOCK)
        hits = [o.num_cached_tokens for _, o in cached[turn]]
        assert sum(hits) >= 0.9 * sum(reusable), (kind, turn, hits, reusable)
    assert_pool_full(cached_engine)


def test_sliding_window_booking_window_mode_still_hits(tiny_model):
    """With blocks freed outside the window, hits still come from the window blocks."""
    path = tiny_model("mistral", sliding_window=8)
    engine = engine_for(path, True, sliding_window_booking="window")
    assert type(engine.kv_cache.groups[0].spec).__name__ == "SlidingWindowSpec"
    turns = multi_turn(engine)
    plain = multi_turn(engine_for(path, False))
    assert [o.outputs[0].token_ids for t in turns for _, o in t] == [
        o.outputs[0].token_ids for t in plain for _, o in t
    ]
    assert sum(o.num_cached_tokens for t in turns[1:] for _, o in t) > 0
    assert_pool_full(engine)


def test_auto_booking_books_all_sliding_model_as_full(tiny_model):
    path = tiny_model("mistral", sliding_window=8)
    assert type(engine_for(path, True).kv_cache.groups[0].spec).__name__ == "FullAttentionSpec"
    assert type(engine_for(path, False).kv_cache.groups[0].spec).__name__ == "SlidingWindowSpec"


def test_stats_expose_prefix_hits(tiny_model):
    engine = engine_for(tiny_model("llama"), True)
    multi_turn(engine, num_turns=2)
    stats = engine.stats()
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["prefix_cache_queried_tokens"] >= stats["prefix_cache_hit_tokens"]
    assert stats["prefix_cache_hit_tokens_per_group"][0] >= stats["prefix_cache_hit_tokens"]


def test_cache_salt_never_shares_hits(tiny_model):
    engine = engine_for(tiny_model("llama"), True)
    prompt = list(range(5, 45))
    from kvloom import SamplingParams

    params = SamplingParams(max_tokens=2, temperature=0.0)
    for i, salt in enumerate(["a", "b", "a", None, "b"]):
        engine.add_request(str(i), {"prompt_token_ids": prompt, "cache_salt": salt}, params)
        while engine.has_unfinished_requests():
            outs = [o for o in engine.step() if o.finished]
            if outs:
                result = outs[0]
        expected_hit = i in (2, 4)  # same salt seen before
        assert (result.num_cached_tokens > 0) == expected_hit, (i, salt, result.num_cached_tokens)


class _AlwaysDue(dict):
    """A `_publish_due` that never lets `publish_computed_blocks` skip a request."""

    def get(self, key, default=None):
        return 0


@pytest.mark.parametrize("max_batched", [None, 7], ids=["whole", "chunked"])
@pytest.mark.parametrize("kind", ["dense", "sliding", *HYBRIDS])
def test_publish_skips_change_nothing(tiny_model, hybrid_model, kind, max_batched, monkeypatch):
    """publish_computed_blocks skips a request until a block can have filled; the cache
    must hold the same blocks under the same keys, step for step, as publishing every
    step, and the skip must be taken. Chunked prefills keep linear-state checkpoints
    inside a block (one token before a prompt's end), which must not wait for it."""
    if kind in HYBRIDS:
        path = hybrid_model(kind)
    else:
        arch, overrides = MODELS[kind]
        path = tiny_model(arch, **overrides)

    def run(skips: bool):
        kw = {} if max_batched is None else {"max_num_batched_tokens": max_batched}
        engine = engine_for(path, True, **kw)
        coordinator = engine.core.kv_cache
        if not skips:
            coordinator._publish_due = _AlwaysDue()
        published, skipped = [], 0
        publish = coordinator.publish_computed_blocks

        def recording(request):
            nonlocal skipped
            skipped += request.num_computed_tokens < coordinator._publish_due.get(
                request.request_id, 0
            )
            publish(request)
            published.append(sorted(coordinator.pool._cached))

        monkeypatch.setattr(coordinator, "publish_computed_blocks", recording)
        turns = multi_turn(engine)
        hits = [[o.num_cached_tokens for _, o in turn] for turn in turns]
        return hits, published, skipped

    hits_skip, published_skip, skipped = run(True)
    hits_all, published_all, _ = run(False)
    assert hits_skip == hits_all
    assert published_skip == published_all
    assert skipped > 0
