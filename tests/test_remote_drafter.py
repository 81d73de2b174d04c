"""`speculative_config["placement"] = "remote"`: the drafter runs in its own Ray actor and
drafts over a zmq channel. Greedy outputs equal no speculation (draft model and EAGLE head,
synchronous and async scheduling); a drafter killed mid-stream (SIGKILL) leaves every
request finishing with the right tokens, without speculation until it is back; a drafter
of another protocol version is not used; settings it cannot serve fail at start."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
import zmq

from kvloom import Engine
from kvloom.workers.spec_decode.drafter_messages import (
    DRAFTER_PROTOCOL_VERSION,
    DraftError,
    DraftReady,
    DraftRequest,
    DraftSetup,
    encoder,
    from_drafter,
    to_drafter,
)
from kvloom.workers.spec_decode.eagle import write_eagle_head
from kvloom.workers.spec_decode.remote_drafter import RemoteDrafter
from tests.engine_helpers import greedy, run_to_completion
from tests.test_spec_decode_engine import record_steps, repetitive_prompts

pytestmark = pytest.mark.slow

PROMPTS = repetitive_prompts(4)
SMALL = dict(block_size=4, num_kv_blocks=80, max_num_batched_tokens=16, max_model_len=256)


def make_engine(path, spec=None, **kw) -> Engine:
    return Engine(
        model=str(path),
        dtype="float64",
        device="cpu",
        progress=False,
        speculative_config=spec,
        **{**SMALL, **kw},
    )


def remote(method: str, model, k: int = 3) -> dict:
    return {
        "method": method,
        "model": str(model),
        "num_speculative_tokens": k,
        "placement": "remote",
    }


@pytest.fixture(scope="module")
def target(tiny_model):
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def expected(target) -> list[list[int]]:
    """Greedy tokens without speculation (in process)."""
    outs = run_to_completion(make_engine(target), PROMPTS, greedy(16))
    return [o.outputs[0].token_ids for o in outs]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# A shared-prefix workload (prefix hits), run in a pool too small for it (preemption).
PREFIX = repetitive_prompts(1)[0][:20]
TIGHT_POOL = 18  # 4-token blocks: the four requests of the second wave need about 25


def shared_prefix_tokens(eng: Engine, max_tokens: int = 12) -> list[list[int]]:
    """Greedy tokens of one request alone (its prompt's blocks enter the prefix cache),
    then four at once whose prompts start with the same 20 tokens."""
    first = run_to_completion(eng, [PREFIX + [7, 8]], greedy(max_tokens))
    wave = [PREFIX + [9 + i] * (i + 1) for i in range(4)]
    return tokens(first + run_to_completion(eng, wave, greedy(max_tokens)))


def assert_preempted_and_hit(stats: dict) -> None:
    assert stats["num_preemptions"] > 0, "the workload did not preempt"
    assert stats["prefix_cache_hit_tokens"] > 0, "the workload had no prefix hits"


def test_remote_draft_model_is_lossless_under_preemption_and_prefix_hits(local_ray, target):
    """The target as its own remote draft: its KV in the actor follows the target's block
    ids through prefix hits and recomputed (preempted) requests, so every draft is
    accepted; tokens equal no speculation."""
    want = shared_prefix_tokens(make_engine(target))
    eng = make_engine(
        target, remote("draft_model", target), executor="ray", num_kv_blocks=TIGHT_POOL
    )
    try:
        assert shared_prefix_tokens(eng) == want
        stats = eng.stats()
        assert_preempted_and_hit(stats)
        assert stats["spec_accepted_tokens"] == stats["spec_drafted_tokens"] > 0
        assert ray_get(eng.executor.drafter.target_parameters) == {}  # a draft model: none
    finally:
        eng.shutdown()


def ray_get(method):
    import ray

    return ray.get(method.remote())


def test_remote_draft_model_is_lossless_at_tp2_with_async_scheduling(local_ray, target, expected):
    """The target (at TP 2: rank 0 shares the drafts) as its own remote draft: every draft
    is accepted, tokens unchanged (the synchronous engine at TP 1: the kill test below)."""
    eng = make_engine(
        target,
        remote("draft_model", target),
        executor="ray",
        async_scheduling=True,
        tensor_parallel_size=2,
    )
    try:
        assert eng.stats()["spec_drafter_available"] is True
        assert tokens(run_to_completion(eng, PROMPTS, greedy(16))) == expected
        stats = eng.stats()
        assert stats["spec_drafted_tokens"] > 0
        assert stats["spec_accepted_tokens"] == stats["spec_drafted_tokens"]  # self-draft
    finally:
        eng.shutdown()


def test_remote_eagle_head_on_a_hybrid_target_is_lossless(local_ray, hybrid_model, tmp_path):
    """An all-sliding-window EAGLE head (booked into the target's full-attention group) for
    a Qwen3-Next target, whose rejected drafts roll the linear state back."""
    path = hybrid_model("qwen3_next")
    hybrid = dict(block_size=16, num_kv_blocks=120)
    plain = tokens(run_to_completion(make_engine(path, **hybrid), PROMPTS, greedy(16)))
    head = write_eagle_head(tmp_path / "head", path, sliding_window=8)
    eng = make_engine(path, remote("eagle", head), executor="ray", **hybrid)
    try:
        assert tokens(run_to_completion(eng, PROMPTS, greedy(16))) == plain
        assert eng.stats()["spec_drafted_tokens"] > 0
    finally:
        eng.shutdown()


def drafter_pid(eng: Engine) -> int:
    import ray

    return ray.get(eng.executor.drafter.pid.remote())


def test_a_drafter_killed_mid_stream_leaves_requests_finishing_without_speculation(
    local_ray, target, expected
):
    eng = make_engine(target, remote("draft_model", target), executor="ray")
    steps = record_steps(eng)
    prompts = PROMPTS
    try:
        for i, prompt in enumerate(prompts):
            eng.add_request(str(i), {"prompt_token_ids": prompt}, greedy(16))
        for _ in range(4):
            eng.step()
        assert any(s.scheduled_spec_token_ids for s in steps), "no drafts before the kill"
        killed_at = len(steps)
        os.kill(drafter_pid(eng), signal.SIGKILL)
        done = {}
        start = time.monotonic()
        while eng.has_unfinished_requests():
            assert time.monotonic() - start < 120, "requests did not finish after the kill"
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
        assert [done[str(i)].outputs[0].token_ids for i in range(len(prompts))] == expected
        assert {o.outputs[0].finish_reason for o in done.values()} == {"length"}
        # The step after the one the drafter missed verifies no drafts: served without them.
        after = steps[killed_at + 1 :]
        assert after and not after[0].scheduled_spec_token_ids, after[0]
        # Ray restarts the actor; the worker reconnects and speculates again.
        deadline = time.monotonic() + 60
        while not eng.stats().get("spec_drafter_available"):
            assert time.monotonic() < deadline, "the drafter actor did not come back"
            time.sleep(0.5)
        time.sleep(1.5)  # the worker retries its connection about once a second
        drafted = eng.stats()["spec_drafted_tokens"]
        again = run_to_completion(eng, prompts, greedy(16))
        assert tokens(again) == expected
        assert eng.stats()["spec_drafted_tokens"] > drafted, "no drafts after the restart"
    finally:
        eng.shutdown()


class FakeDrafter:
    """A ROUTER socket on loopback answering every message with `answer(msg)`."""

    def __init__(self, answer):
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.answer = answer
        self.stop = False
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while not self.stop:
            if self.sock.poll(50):
                identity, payload = self.sock.recv_multipart()
                reply = self.answer(payload)
                if reply is not None:
                    self.sock.send_multipart([identity, reply])

    def close(self):
        self.stop = True
        self.thread.join(5)
        self.sock.close(0)
        self.context.term()


class FakeHandle:
    """Stands for the drafter actor's Ray handle: `address.remote()` is a ready ref."""

    def __init__(self, ray, address):
        self.address = type("M", (), {"remote": staticmethod(lambda: ray.put(address))})()


def empty_request() -> DraftRequest:
    return DraftRequest(
        version=DRAFTER_PROTOCOL_VERSION,
        step_id=1,
        request_ids=[],
        input_ids=[],
        positions=[],
        query_start_loc=[0],
        num_computed_tokens=[],
        decode_only=False,
        block_ids={},
        drafts={},
        sampled={},
        finished=[],
        num_tokens={},
        hidden=None,
    )


def groups_of_one_attention_group(block_size=4):
    from kvloom.contracts.kv_cache_spec import FullAttentionSpec, KVCacheGroup

    return [KVCacheGroup(spec=FullAttentionSpec(block_size, 1, 8, "float32"), layer_names=[])]


def test_a_drafter_of_another_protocol_version_is_not_used(local_ray, caplog):
    from kvloom.contracts.config import SpeculativeConfig

    def other_version(payload):
        msg = to_drafter.decode(payload)
        assert isinstance(msg, DraftSetup) and msg.version == DRAFTER_PROTOCOL_VERSION
        return encoder.encode(DraftReady(DRAFTER_PROTOCOL_VERSION + 1, msg.setup_id))

    fake = FakeDrafter(other_version)
    drafter = RemoteDrafter(SpeculativeConfig(method="ngram", num_speculative_tokens=2), 1.0)
    try:
        drafter.attach(FakeHandle(local_ray, fake.address))
        with caplog.at_level(logging.WARNING):
            drafter.kv_cache_ready(16, groups_of_one_attention_group())
            assert not drafter.available
            drafter._retry_at = 0.0
            assert not drafter._reconnect()  # tried again: still the wrong version
        warnings = [r.getMessage() for r in caplog.records if "remote drafter" in r.getMessage()]
        assert len(warnings) == 1, warnings  # logged once per outage
        assert "protocol version" in warnings[0]
        assert drafter.num_outages == 1
    finally:
        drafter.close()
        fake.close()


def test_a_silent_drafter_times_out_and_a_late_answer_is_dropped(local_ray):
    from kvloom.contracts.config import SpeculativeConfig

    def ready_only(payload):
        msg = to_drafter.decode(payload)
        if isinstance(msg, DraftSetup):
            return encoder.encode(DraftReady(DRAFTER_PROTOCOL_VERSION, msg.setup_id))
        return None  # never drafts

    fake = FakeDrafter(ready_only)
    drafter = RemoteDrafter(SpeculativeConfig(method="ngram", num_speculative_tokens=2), 0.3)
    try:
        drafter.attach(FakeHandle(local_ray, fake.address))
        drafter.kv_cache_ready(16, groups_of_one_attention_group())
        assert drafter.available
        msg = empty_request()
        start = time.monotonic()
        assert drafter._exchange(msg, 0.3) is None
        assert 0.25 < time.monotonic() - start < 5
        assert not drafter.available and drafter.num_outages == 1
    finally:
        drafter.close()
        fake.close()


def test_the_drafter_answers_a_bad_version_and_an_early_step_with_an_error(target):
    import torch

    from kvloom.contracts.config import EngineConfig
    from kvloom.workers.spec_decode.drafter_server import DrafterService

    config = EngineConfig.from_kwargs(
        model=str(target),
        dtype="float64",
        speculative_config={
            "method": "draft_model",
            "model": str(target),
            "num_speculative_tokens": 2,
        },
    )
    service = DrafterService(config, torch.device("cpu"))
    wrong = encoder.encode(DraftSetup(DRAFTER_PROTOCOL_VERSION + 1, 1, 16, 4, 2))
    reply = service.handle(wrong)
    assert isinstance(reply, DraftError) and "protocol version" in reply.message
    assert isinstance(service.handle(b"\x00not msgpack"), DraftError)
    reply = service.handle(encoder.encode(empty_request()))
    assert isinstance(reply, DraftError) and "not set up" in reply.message
    ready = service.handle(encoder.encode(DraftSetup(DRAFTER_PROTOCOL_VERSION, 7, 16, 4, 2)))
    assert from_drafter.decode(encoder.encode(ready)) == DraftReady(DRAFTER_PROTOCOL_VERSION, 7)


@pytest.mark.parametrize(
    "spec, kw, words",
    [
        ({"method": "ngram", "num_speculative_tokens": 2, "placement": "remote"}, {}, "ngram"),
        # An MTP-less target (a dense Qwen3) cannot draft for itself, remote or not.
        ({"method": "mtp", "num_speculative_tokens": 1, "placement": "remote"}, {}, "MTP"),
    ],
)
def test_settings_a_remote_drafter_cannot_serve_fail_at_start(local_ray, target, spec, kw, words):
    spec = spec or remote("draft_model", target)
    with pytest.raises(ValueError, match=words):
        make_engine(target, spec, executor="ray", **kw)


def test_remote_placement_needs_the_ray_executor(target):
    with pytest.raises(ValueError, match="executor='ray'"):
        make_engine(target, remote("draft_model", target), executor="inprocess")


@pytest.mark.gpu
def test_remote_draft_model_on_cuda_is_lossless(local_ray, target):
    """On a GPU target: the drafter actor takes a GPU of its own when one is free (else the
    CPU); greedy float32 tokens equal no speculation on the same GPU."""
    gpu = dict(device="cuda", dtype="float32", num_kv_blocks=256)
    local = Engine(model=str(target), executor="inprocess", progress=False, **gpu)
    expected = tokens(run_to_completion(local, PROMPTS, greedy(16)))
    local.shutdown()
    eng = Engine(
        model=str(target),
        executor="ray",
        progress=False,
        speculative_config=remote("draft_model", target),
        **gpu,
    )
    try:
        assert tokens(run_to_completion(eng, PROMPTS, greedy(16))) == expected
        stats = eng.stats()
        assert stats["spec_accepted_tokens"] > 0 and stats["spec_drafter_available"]
    finally:
        eng.shutdown()
