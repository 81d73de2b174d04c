"""A request the KV pool can never hold ends with a clear error; the engine keeps serving
the others and every block returns to the pool (before, the queue stalled forever)."""

from __future__ import annotations

from kvloom import Engine
from tests.engine_helpers import assert_pool_full, greedy


def make_engine(model: str) -> Engine:
    # 5 usable blocks of 4 tokens: 20 tokens in all.
    return Engine(
        model=model,
        dtype="float32",
        progress=False,
        block_size=4,
        num_kv_blocks=6,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
    )


def run(engine: Engine) -> dict:
    done = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert not engine.has_unfinished_requests(), "the engine stalled"
    return done


def test_prompt_larger_than_the_pool_is_rejected_and_others_are_served(tiny_model):
    engine = make_engine(tiny_model("llama"))
    engine.add_request("big", {"prompt_token_ids": list(range(3, 33))}, greedy(4))
    engine.add_request("small", {"prompt_token_ids": [5, 6, 7, 8, 9]}, greedy(4))
    done = run(engine)
    assert done["big"].outputs[0].finish_reason == "error"
    assert "KV cache cannot hold this request" in done["big"].outputs[0].stop_reason
    assert done["small"].outputs[0].finish_reason == "length"
    assert len(done["small"].outputs[0].token_ids) == 4
    assert_pool_full(engine)


def test_request_that_outgrows_the_pool_while_decoding_ends_with_an_error(tiny_model):
    engine = make_engine(tiny_model("llama"))
    engine.add_request("grows", {"prompt_token_ids": list(range(3, 13))}, greedy(20))
    done = run(engine)
    out = done["grows"].outputs[0]
    assert out.finish_reason == "error"
    # It decoded until its 20-token pool was full, then could not go on even alone.
    assert 0 < len(out.token_ids) < 20
    assert_pool_full(engine)


def test_through_the_front_door_it_is_that_requests_error_not_the_engines(tiny_model):
    """An unfittable request ends in error without the engine failing: the front door
    refuses that request (RequestRejected: INVALID_ARGUMENT) and keeps serving; before, any
    output ending in error was read as the whole replica's failure."""
    import asyncio

    import pytest

    from kvloom.cluster.frontend.async_engine import AsyncEngine, RequestRejected

    model = str(tiny_model("llama"))

    async def main():
        fatal = []
        engine = AsyncEngine(lambda: make_engine(model), on_fatal=fatal.append)
        await engine.start()
        big = engine.add("big", {"prompt_token_ids": list(range(3, 33))}, greedy(4))
        small = engine.add("small", {"prompt_token_ids": [5, 6, 7, 8, 9]}, greedy(4))
        with pytest.raises(RequestRejected, match="KV cache cannot hold this request"):
            async for _ in big:
                pass
        assert sum([len(d.token_ids) async for d in small]) == 4  # the stream: deltas
        assert not fatal and engine.running
        stats = await engine.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]
        await engine.shutdown()

    asyncio.run(main())
