"""The one output path end to end (cluster/engine.py OutputEngine over the engine core): the
core emits per-step token deltas only; a stop string found by the output processor ends
the request in the core at once; the front door's streams get deltas, never cumulative
outputs; and the front door, the output processor and the core share one tokenizer."""

from __future__ import annotations

import asyncio

import pytest

from kvloom import Engine, SamplingParams
from kvloom.cluster import output_processor
from kvloom.cluster.frontend.async_engine import AsyncEngine
from kvloom.cluster.frontend.model_files import load_model_files
from kvloom.cluster.outputs import EngineCoreOutput, OutputDelta
from tests.engine_helpers import assert_pool_full

PROMPT = [5, 17, 33, 91, 120, 7]


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = Engine(model=model_dir, dtype="float32", progress=False, block_size=4)
    yield eng
    eng.shutdown()


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def run(engine: Engine, rid: str, params: SamplingParams):
    engine.add_request(rid, {"prompt_token_ids": PROMPT}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out
    raise AssertionError("no final output")


def test_the_core_emits_only_each_steps_new_tokens(engine):
    engine.core.add_request("core", PROMPT, greedy(5, logprobs=1))
    outs = []
    while engine.core.has_unfinished_requests():
        outs += engine.core.step()
    assert all(isinstance(out, EngineCoreOutput) for out in outs)
    assert [len(out.new_token_ids) for out in outs] == [1] * 5  # no history, no text
    assert [len(out.new_logprobs) for out in outs] == [1] * 5
    assert [out.finish_reason for out in outs] == [None] * 4 + ["length"]
    assert outs[-1].metrics["ttft_s"] >= 0
    assert_pool_full(engine)


def test_a_stop_string_ends_the_request_in_the_core_at_once(engine):
    full = run(engine, "full", greedy(24)).outputs[0]
    # A stop string that completes a few tokens in: text it ends at is cut, not sent.
    cut = next(n for n in range(4, 20) if len(engine.tokenizer.decode(full.token_ids[:n])) >= 3)
    text_at = engine.tokenizer.decode(full.token_ids[:cut])
    stop = text_at[-2:]
    expected = full.text[: full.text.index(stop)]
    finished_before = engine.stats()["num_finished"]
    engine.add_request("stopped", {"prompt_token_ids": PROMPT}, greedy(24, stop=[stop]))
    final = None
    while final is None:
        final = next((out for out in engine.step() if out.finished), None)
    completion = final.outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert completion.text == expected and len(completion.token_ids) < 24
    # Ended in the core by the same step: no request left, every block back, a finish.
    assert "stopped" not in engine.core.scheduler.requests
    assert not engine.has_unfinished_requests()
    assert_pool_full(engine)
    stats = engine.stats()
    assert stats["num_finished"] == finished_before + 1


def test_the_front_door_streams_deltas_never_cumulative_outputs(engine, monkeypatch):
    expected = run(engine, "offline", greedy(12)).outputs[0]
    assert len(expected.text) > 8
    stop = expected.text[5:7]

    def no_cumulative(*args, **kwargs):
        raise AssertionError("the serving path built a cumulative RequestOutput")

    monkeypatch.setattr(output_processor, "_request_output", no_cumulative)

    async def main():
        served = AsyncEngine(lambda: engine)
        served.coalesce = False  # every step's delta, as it was made
        await served.start()
        params = greedy(12, logprobs=1)
        deltas = [d async for d in served.add("a", {"prompt_token_ids": PROMPT}, params)]
        params = greedy(12, stop=[stop])
        stopped = [d async for d in served.add("b", {"prompt_token_ids": PROMPT}, params)]
        await served.shutdown()
        return deltas, stopped

    monkeypatch.setattr(engine, "shutdown", lambda: None)  # the module's engine lives on
    monkeypatch.setattr(engine.output_processor, "keep_history", True)  # restored after
    deltas, stopped = asyncio.run(main())
    assert all(isinstance(d, OutputDelta) for d in deltas)
    assert [len(d.token_ids) for d in deltas] == [1] * 12  # each token once
    assert [len(d.logprobs) for d in deltas] == [1] * 12  # each logprob once, none kept
    assert not engine.output_processor.keep_history
    assert "".join(d.text for d in deltas) == expected.text
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
    assert deltas[-1].finished and deltas[-1].completion_tokens == 12
    text = "".join(d.text for d in stopped)
    assert text == expected.text[: expected.text.index(stop)]
    assert stopped[-1].stop_reason == stop and stopped[-1].finish_reason == "stop"
    assert_pool_full(engine)


def test_one_tokenizer_object_per_process(engine, model_dir):
    files = load_model_files(model_dir)
    assert files.tokenizer is engine.tokenizer
    assert engine.output_processor.tokenizer is engine.tokenizer
    assert engine.core.tokenizer is engine.tokenizer
