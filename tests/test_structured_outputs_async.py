"""Structured outputs under async scheduling: grammar rows are scheduled ahead like any
other, their masks follow the step once the previous step's tokens are read back (in
process: handed to the runner; Ray: a side message on the step channel), and outputs
equal the synchronous engine's, greedy and seeded, mixed with plain requests, with
preemption (float64 on CPU: exact comparisons)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvloom import Engine, SamplingParams, StructuredOutputsParams
from kvloom.cluster.engine_channel import RequestError
from kvloom.contracts.scheduler_output import GrammarBitmasks, SchedulerOutput
from kvloom.contracts.step_channel import FLUSH, StepPublisher, StepSubscriber
from kvloom.workers.awaiting_masks import AwaitingMasksStep
from tests.engine_helpers import assert_pool_full

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ada", "bob"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,4}-\d{2}"
CHOICES = ["yes", "no", "maybe so"]
KINDS = (("json", SCHEMA), ("regex", REGEX), ("choice", CHOICES))
# Small pool and budget: requests are preempted while a step is in flight.
ENGINE = dict(
    dtype="float64", block_size=4, max_model_len=256, num_kv_blocks=24, max_num_batched_tokens=24
)


def workload() -> dict[str, SamplingParams]:
    params = {}
    for kind, spec in KINDS:
        so = StructuredOutputsParams(**{kind: spec})
        params[f"{kind}-greedy"] = SamplingParams(
            max_tokens=64, temperature=0.0, structured_outputs=so
        )
        params[f"{kind}-seeded"] = SamplingParams(
            max_tokens=64, temperature=1.0, seed=7, structured_outputs=so
        )
    params["free-greedy"] = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    params["free-seeded"] = SamplingParams(max_tokens=24, temperature=0.9, seed=3)
    return params


def run(engine: Engine, params: dict[str, SamplingParams]) -> dict:
    for rid, p in params.items():
        engine.add_request(rid, "hello there, a longer prompt", p)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert not isinstance(out, RequestError), out
            if out.finished:
                outs[out.request_id] = out.outputs[0]
    return outs


def check(got: dict, want: dict) -> None:
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in want.items()}
    for rid, out in got.items():
        assert out.finish_reason == want[rid].finish_reason
        if rid.startswith("json"):
            assert out.finish_reason == "stop"
            jsonschema.validate(json.loads(out.text), SCHEMA)
        elif rid.startswith("regex"):
            assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text)
        elif rid.startswith("choice"):
            assert out.finish_reason == "stop" and out.text in CHOICES


def make_engine(path, **kwargs) -> Engine:
    return Engine(model=str(path), progress=False, **{"device": "cpu", **ENGINE, **kwargs})


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    engine = make_engine(model_dir, async_scheduling=False)
    try:
        outs = run(engine, workload())
        assert engine.scheduler.num_grammar_rows_ahead == 0
    finally:
        engine.shutdown()
    return outs


def test_in_process_grammar_rows_run_ahead_with_the_synchronous_outputs(model_dir, reference):
    engine = make_engine(model_dir, async_scheduling=True)
    sent: list[GrammarBitmasks] = []
    send = engine.executor.send_bitmasks
    engine.executor.send_bitmasks = lambda masks: sent.append(masks) or send(masks)
    try:
        assert engine.async_scheduling
        got = run(engine, workload())
        assert engine.stats()["num_preemptions"] > 0
        assert engine.scheduler.num_grammar_rows_ahead > 0
        # Every mask that followed a step went to that step, after it was launched.
        assert sent and all(m.bitmasks for m in sent[:3])
        assert engine.executor.worker.runner.awaiting_masks is None
        assert_pool_full(engine)
    finally:
        engine.shutdown()
    check(got, reference)


def test_ray_grammar_rows_run_ahead_with_the_synchronous_outputs(local_ray, model_dir, reference):
    engine = make_engine(model_dir, executor="ray", async_scheduling=True)
    try:
        assert engine.async_scheduling
        got = run(engine, workload())
        assert engine.stats()["num_preemptions"] > 0
        assert engine.scheduler.num_grammar_rows_ahead > 0
        # The step launched behind the last tokens (rows of requests that ended) got its
        # masks already: reading it back does not wait for them.
        for _ in range(3):
            if engine._in_flight is None:
                break
            assert engine.step() == []
        ex = engine.executor
        assert ex._num_received == ex._num_submitted and not ex._unclaimed
        assert_pool_full(engine)
    finally:
        engine.shutdown()
    check(got, reference)


def test_a_request_ended_by_the_token_in_flight_gets_no_mask(model_dir):
    """A one-letter choice ends with its second token (the letter, then the stop token
    the grammar then allows alone); the step scheduled ahead of that token's read-back
    still holds the request's row, which gets no mask (the row is sampled unmasked and
    discarded) and leaves nothing behind."""
    engine = make_engine(model_dir, async_scheduling=True)
    sent: list[GrammarBitmasks] = []
    send = engine.executor.send_bitmasks
    engine.executor.send_bitmasks = lambda masks: sent.append(masks) or send(masks)
    try:
        one = SamplingParams(
            max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputsParams(choice=["a"])
        )
        got = run(engine, {"short": one, "free": SamplingParams(max_tokens=8, temperature=0.0)})
        assert got["short"].finish_reason == "stop" and got["short"].text == "a"
        # The mask after "a" (stop token only) followed a step; the one after the stop
        # token has no row for the ended request.
        assert [("short" in m.bitmasks) for m in sent] == [True, False]
        assert got["short"].token_ids[-1] in engine.core.tokenizer.eos_token_ids
        assert_pool_full(engine)
    finally:
        engine.shutdown()


def test_masks_must_match_their_step():
    step = AwaitingMasksStep(5, lambda masks: None)
    with pytest.raises(RuntimeError, match="read back before its grammar masks"):
        step.result()
    with pytest.raises(RuntimeError, match="step_id 4 arrived for step 5"):
        step.supply(GrammarBitmasks(4))
    with pytest.raises(ValueError, match="GrammarBitmasks.version 9"):
        step.supply(GrammarBitmasks(5, version=9))


def test_masks_travel_as_side_messages_in_step_order():
    """Over Ray the masks are a side message on the step channel: numbered and ordered
    with the steps and flush markers, decoded by the subscriber's side type."""
    masks = GrammarBitmasks(3, {"a": b"\x01\x00\x00\x00"})
    with StepPublisher(1, ready_timeout=30) as pub:
        sub = StepSubscriber(pub.address, msg_type=SchedulerOutput, side_type=GrammarBitmasks)
        try:
            pub.publish(SchedulerOutput(step_id=3, grammar_bitmasks_follow=["a"]))
            pub.publish_side(masks)
            pub.publish_flush()
            step = sub.recv(timeout=30)
            assert isinstance(step, SchedulerOutput) and step.grammar_bitmasks_follow == ["a"]
            assert sub.recv(timeout=30) == masks
            assert sub.recv(timeout=30) is FLUSH
        finally:
            sub.close()


@pytest.mark.gpu
def test_gpu_grammar_rows_run_ahead_with_the_synchronous_outputs(model_dir):
    """On CUDA (async scheduling's default there): the mask build overlaps step N+1's
    forward, and the sampled tokens are those of the synchronous engine."""
    runs = []
    for mode in (None, False):
        engine = make_engine(model_dir, device="cuda", dtype="float32", async_scheduling=mode)
        try:
            assert engine.async_scheduling is (mode is None)
            runs.append(run(engine, workload()))
            assert (engine.scheduler.num_grammar_rows_ahead > 0) is (mode is None)
            assert_pool_full(engine)
        finally:
            engine.shutdown()
    check(runs[0], runs[1])
