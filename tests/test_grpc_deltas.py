"""The front door's per-request machinery without a network: responders on the output
processor's deltas, and the AsyncEngine's thread hand-off (queue bound, duplicate ids,
coalescing of deltas, failures, aborts ending a stream at once). The output processor
itself: tests/test_output_processor.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvloom import SamplingParams
from kvloom.cluster.engine import OutputEngine
from kvloom.cluster.engine_channel import RequestError
from kvloom.cluster.frontend.async_engine import AsyncEngine
from kvloom.cluster.frontend.errors import EngineDead, QueueFull, RequestIdInUse
from kvloom.cluster.frontend.responses import ChatResponder, TokenTexts, position_logprobs
from kvloom.cluster.outputs import EngineCoreOutput, Logprob, OutputDelta
from kvloom.cluster.parsers import ChatOutputParser, make_reasoning_parser, make_tool_call_parser
from kvloom.contracts.config import EngineConfig
from kvloom.protos.kvloom.v1 import generation_pb2 as pb


def delta(text, ids, finished=False, reason=None, rid="r", total=None):
    return OutputDelta(
        rid,
        text,
        list(ids),
        finished=finished,
        finish_reason=reason,
        prompt_tokens=3,
        completion_tokens=total if total is not None else len(ids),
    )


def test_position_logprobs_keeps_the_sampled_token_out_of_a_short_top():
    entry = {9: Logprob(-0.5, 1), 4: Logprob(-0.9, 2), 7: Logprob(-3.0, 6)}
    texts = TokenTexts(lambda ids: f"<{ids[0]}>")
    position = position_logprobs(7, entry, 2, texts)
    assert (position.sampled.token_id, position.sampled.rank, position.sampled.token) == (
        7,
        6,
        "<7>",
    )
    assert [(t.token_id, t.rank) for t in position.top] == [(9, 1), (4, 2)]
    assert position_logprobs(7, entry, 0, texts).top == []


def test_chat_responder_roles_token_only_deltas_and_tool_calls_finish():
    parser = ChatOutputParser(make_reasoning_parser("think"), make_tool_call_parser("hermes"))
    responder = ChatResponder("r", None, TokenTexts(str), parser=parser)
    pieces = ["<think>", "ok</think>", '<tool_call>{"name": "f", "arguments": {}}</tool_call>']
    messages = [responder.update(delta(t, [i])) for i, t in enumerate(pieces)]
    # "<think>" alone is held by the parser: the delta carries only the token id and role.
    assert [m.delta for m in messages[0]] == [pb.ChatDelta(role="assistant", token_ids=[0])]
    assert messages[1][0].delta.reasoning_content == "ok" and messages[1][0].delta.role == ""
    final = responder.update(delta("", [], True, "stop", total=3))
    assert final[-2].finish.reason == pb.FINISH_REASON_TOOL_CALLS
    assert final[-1].usage.completion_tokens == 3
    calls = [
        c
        for m in messages[2] + final
        if m.WhichOneof("kind") == "delta"
        for c in m.delta.tool_calls
    ]
    assert calls[0].name == "f" and "".join(c.arguments for c in calls) == "{}"


class CountingCore:
    """Each step appends one token to every request; requests finish at max_tokens."""

    def __init__(self, model_dir: str, fail_on_step: int | None = None) -> None:
        self.config = EngineConfig.from_kwargs(model=model_dir, max_num_seqs=2)
        self.requests: dict[str, list[int]] = {}
        self.max_tokens: dict[str, int] = {}
        self.steps = 0
        self.fail_on_step = fail_on_step

    def add_request(self, request_id, prompt_token_ids, params, *_):
        if params.max_tokens == 99:
            raise ValueError("prompt: not this one")
        self.requests[request_id] = []
        self.max_tokens[request_id] = params.max_tokens

    def step(self):
        self.steps += 1
        if self.steps == self.fail_on_step:
            raise RuntimeError("boom")
        time.sleep(0.001)
        outs = []
        for rid, ids in list(self.requests.items()):
            ids.append(len(ids))
            done = len(ids) == self.max_tokens[rid]
            outs.append(EngineCoreOutput(rid, [ids[-1]], None, "length" if done else None))
            if done:
                del self.requests[rid]
        return outs

    def abort_requests(self, request_ids, stopped=False):
        for rid in request_ids:
            self.requests.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def stats(self):
        return {"num_running": len(self.requests)}

    def shutdown(self):
        pass


class CountingEngine(OutputEngine):
    def __init__(self, model_dir: str, fail_on_step: int | None = None) -> None:
        super().__init__(CountingCore(model_dir, fail_on_step))


def token_ids(deltas) -> list[int]:
    return [tid for d in deltas for tid in d.token_ids]


def test_async_engine_hand_off(demo_tokenizer_dir):
    async def main():
        engine = AsyncEngine(lambda: CountingEngine(str(demo_tokenizer_dir)), max_waiting=1)
        await engine.start()
        assert engine.max_in_flight == 3  # max_num_seqs 2 + 1 waiting
        lengths = [5, 10**6, 5]  # r1 runs until aborted
        streams = [
            engine.add(f"r{i}", [1], SamplingParams(max_tokens=n)) for i, n in enumerate(lengths)
        ]
        with pytest.raises(QueueFull):
            engine.add("r3", [1], SamplingParams(max_tokens=5))
        with pytest.raises(RequestIdInUse):
            engine.add("r0", [1], SamplingParams(max_tokens=5))
        await asyncio.sleep(0.05)  # let the thread run ahead: the backlog collapses
        outs = [out async for out in streams[0]]
        assert outs[-1].finished and token_ids(outs) == [0, 1, 2, 3, 4]
        assert len(outs) < 5  # merged: nothing lost
        assert all(isinstance(out, OutputDelta) for out in outs)
        assert engine.abort(["r1", "nope"]) == ["r1"]
        aborted = [out async for out in streams[1]]
        assert aborted[-1].finish_reason == "abort" and aborted[-1].finished
        assert [out async for out in streams[2]][-1].finished
        bad = engine.add("bad", [1], SamplingParams(max_tokens=99))
        with pytest.raises(ValueError, match="prompt: not this one"):
            await bad.__anext__()
        assert engine.num_in_flight == 0
        assert (await engine.stats())["num_running"] == 0
        await engine.shutdown()
        with pytest.raises(EngineDead):
            engine.add("late", [1], SamplingParams(max_tokens=1))

    asyncio.run(main())


def test_async_engine_failures(demo_tokenizer_dir):
    async def main():
        def broken():
            raise ValueError("model: no such directory")

        with pytest.raises(ValueError, match="no such directory"):
            await AsyncEngine(broken).start()
        fatal = []
        engine = AsyncEngine(
            lambda: CountingEngine(str(demo_tokenizer_dir), fail_on_step=3), on_fatal=fatal.append
        )
        await engine.start()
        stream = engine.add("r", [1], SamplingParams(max_tokens=50))
        with pytest.raises(RuntimeError, match="boom"):
            async for _ in stream:
                pass
        await asyncio.sleep(0.01)
        assert len(fatal) == 1 and not engine.running
        with pytest.raises(EngineDead):
            engine.add("r2", [1], SamplingParams(max_tokens=1))
        await engine.shutdown()

    asyncio.run(main())


class OneReplicaLost(CountingCore):
    """Request "lost" ends with a lost replica's error on step 2; the rest carry on."""

    def step(self):
        outs = super().step()
        if self.steps == 2 and "lost" in self.requests:
            del self.requests["lost"]
            outs = [o for o in outs if o.request_id != "lost"]
            outs.append(
                RequestError("lost", "model replica 1 failed (worker died)", replica_lost=True)
            )
        return outs


def test_a_lost_replica_fails_only_its_streams(demo_tokenizer_dir):
    """With data-parallel replicas, a replica's failure ends its own streams with
    ReplicaUnavailable (an EngineFailed: UNAVAILABLE to clients) and is not the engine's
    failure: other streams finish, nothing fatal, new requests are admitted."""
    from kvloom.cluster.frontend.async_engine import EngineFailed, ReplicaUnavailable

    async def main():
        fatal = []
        engine = AsyncEngine(
            lambda: OutputEngine(OneReplicaLost(str(demo_tokenizer_dir))), on_fatal=fatal.append
        )
        engine.coalesce = False
        await engine.start()
        lost = engine.add("lost", [1], SamplingParams(max_tokens=50))
        kept = engine.add("kept", [1], SamplingParams(max_tokens=6))
        with pytest.raises(ReplicaUnavailable, match="model replica 1 failed") as err:
            async for _ in lost:
                pass
        assert isinstance(err.value, EngineFailed)
        assert token_ids([o async for o in kept]) == [0, 1, 2, 3, 4, 5]
        assert not fatal and engine.running
        late = engine.add("late", [1], SamplingParams(max_tokens=2))
        assert [o async for o in late][-1].finished
        await engine.shutdown()

    asyncio.run(main())
