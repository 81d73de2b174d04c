"""The front door's per-request machinery without a network: cumulative outputs to deltas
(stop-string hold-back, flush at finish and abort), responders, and the AsyncEngine's
thread hand-off (queue bound, duplicate ids, coalescing, failures)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvloom import SamplingParams
from kvloom.cluster.engine_channel import RequestError
from kvloom.cluster.frontend.async_engine import AsyncEngine, _abort_output
from kvloom.cluster.frontend.errors import EngineDead, QueueFull, RequestIdInUse
from kvloom.cluster.frontend.output_deltas import OutputDeltaTracker
from kvloom.cluster.frontend.responses import ChatResponder, TokenTexts, position_logprobs
from kvloom.cluster.output_processor import OutputProcessor
from kvloom.cluster.outputs import CompletionOutput, Logprob, RequestOutput
from kvloom.cluster.parsers import ChatOutputParser, make_reasoning_parser, make_tool_call_parser
from kvloom.cluster.request import Request, RequestStatus
from kvloom.cluster.tokenizer import Tokenizer
from kvloom.contracts.config import EngineConfig
from kvloom.protos.kvloom.v1 import generation_pb2 as pb


def output(text, ids, finished=False, reason=None, stop=None, rid="r"):
    completion = CompletionOutput(0, text, list(ids), finish_reason=reason, stop_reason=stop)
    return RequestOutput(rid, None, [1, 2, 3], [completion], finished, num_cached_tokens=0)


def test_stop_string_prefix_is_held_back_until_finish():
    tracker = OutputDeltaTracker(["STOP"])
    texts = [d.text for d in (
        tracker.update(output("ab", [1])),
        tracker.update(output("abS", [1, 2])),  # "S" may start STOP
        tracker.update(output("abST", [1, 2, 3])),
        tracker.update(output("abSTOx", [1, 2, 3, 4])),  # "STOx" is no stop: all goes
    )]  # fmt: skip
    assert texts == ["ab", "", "", "STOx"]
    final = tracker.update(output("abSTOx", [1, 2, 3, 4], True, "length"))
    assert final.text == "" and final.finished and final.completion_tokens == 4


def test_cut_at_stop_sends_nothing_of_it_and_abort_flushes_the_rest():
    tracker = OutputDeltaTracker(["STOP"])
    assert tracker.update(output("hi ST", [1, 2])).text == "hi "
    final = tracker.update(output("hi ", [1, 2, 3], True, "stop", "STOP"))
    assert final.text == "" and final.stop_reason == "STOP"
    tracker = OutputDeltaTracker(["STOP"])
    assert tracker.update(output("hi ST", [1, 2])).text == "hi "
    final = tracker.update(output("hi ST", [1, 2], True, "abort"))
    assert final.text == "ST" and final.finish_reason == "abort"  # invariant 8


def test_token_ids_and_logprobs_come_once_each():
    tracker = OutputDeltaTracker()
    lps = [{5: Logprob(-0.1, 1)}, {6: Logprob(-0.2, 1)}, {7: Logprob(-0.3, 1)}]
    first = output("a", [5])
    first.outputs[0].logprobs = lps[:1]
    second = output("abc", [5, 6, 7])
    second.outputs[0].logprobs = lps
    assert tracker.update(first).token_ids == [5]
    delta = tracker.update(second)
    assert delta.token_ids == [6, 7] and delta.logprobs == lps[1:] and delta.text == "bc"


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
    responder = ChatResponder("r", None, None, TokenTexts(str), parser=parser)
    texts = [
        "<think>",
        "<think>ok</think>",
        '<think>ok</think><tool_call>{"name": "f", "arguments": {}}</tool_call>',
    ]
    messages = [responder.update(output(t, range(i + 1))) for i, t in enumerate(texts)]
    # "<think>" alone is held by the parser: the delta carries only the token id and role.
    assert [m.delta for m in messages[0]] == [pb.ChatDelta(role="assistant", token_ids=[0])]
    assert messages[1][0].delta.reasoning_content == "ok" and messages[1][0].delta.role == ""
    final = responder.update(output(texts[-1], range(3), True, "stop"))
    assert final[-2].finish.reason == pb.FINISH_REASON_TOOL_CALLS
    assert final[-1].usage.completion_tokens == 3
    calls = [
        c
        for m in messages[2] + final
        if m.WhichOneof("kind") == "delta"
        for c in m.delta.tool_calls
    ]
    assert calls[0].name == "f" and "".join(c.arguments for c in calls) == "{}"


def test_abort_output_flushes_the_detokenizers_utf8_hold_back(demo_tokenizer_dir):
    """An aborted request whose last token is half of a character: the engine holds the
    bytes back; the final abort output carries them (as the tokenizer decodes them)."""
    tokenizer = Tokenizer(demo_tokenizer_dir)
    euro = tokenizer.encode("€", add_special_tokens=False)
    assert len(euro) == 3  # three byte tokens: the first two are incomplete UTF-8
    processor = OutputProcessor(tokenizer)
    request = Request("r", tokenizer.encode("Price: "), SamplingParams())
    processor.add(request)
    for step in (tokenizer.encode(" 5", add_special_tokens=False), euro[:2]):
        for token_id in step:
            request.append_output_token(token_id)
        processor.process(request, None)
    last = processor.make_output(request, finished=False)
    assert last.outputs[0].text == " 5"  # the half character is held back
    request.status = RequestStatus.FINISHED_ABORTED
    final = processor.abort_output(request)
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert final.outputs[0].text.startswith(" 5") and len(final.outputs[0].text) > 2
    assert final.outputs[0].token_ids == last.outputs[0].token_ids
    assert "r" not in processor.states and processor.abort_output(request) is None
    # The front door ends the stream with the engine's final output when there is one...
    assert _abort_output([final], last, "r", request.prompt_token_ids) is final
    # ...else with the last output it delivered, marked aborted.
    fallback = _abort_output([], last, "r", request.prompt_token_ids)
    assert fallback.finished and fallback.outputs[0].finish_reason == "abort"
    assert fallback.outputs[0].text == " 5"


class CountingEngine:
    """Each step appends one token to every request; requests finish at max_tokens."""

    def __init__(self, model_dir: str, fail_on_step: int | None = None) -> None:
        self.config = EngineConfig.from_kwargs(model=model_dir, max_num_seqs=2)
        self.requests: dict[str, tuple[list[int], int]] = {}
        self.steps = 0
        self.fail_on_step = fail_on_step

    def add_request(self, request_id, prompt, params):
        if params.max_tokens == 99:
            raise ValueError("prompt: not this one")
        self.requests[request_id] = ([], params.max_tokens)

    def step(self):
        self.steps += 1
        if self.steps == self.fail_on_step:
            raise RuntimeError("boom")
        time.sleep(0.001)
        outs = []
        for rid, (ids, max_tokens) in list(self.requests.items()):
            ids.append(len(ids))
            done = len(ids) == max_tokens
            outs.append(output("x" * len(ids), ids, done, "length" if done else None, rid=rid))
            if done:
                del self.requests[rid]
        return outs

    def abort_request(self, request_id):
        self.requests.pop(request_id, None)
        return []  # no final output: the front door makes it from the last one

    def has_unfinished_requests(self):
        return bool(self.requests)

    def stats(self):
        return {"num_running": len(self.requests)}

    def shutdown(self):
        pass


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
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == [0, 1, 2, 3, 4]
        assert len(outs) < 5
        assert engine.abort(["r1", "nope"]) == ["r1"]
        aborted = [out async for out in streams[1]]
        assert aborted[-1].outputs[0].finish_reason == "abort"
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


class OneReplicaLost(CountingEngine):
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
        engine = AsyncEngine(lambda: OneReplicaLost(str(demo_tokenizer_dir)), on_fatal=fatal.append)
        engine.coalesce = False
        await engine.start()
        lost = engine.add("lost", [1], SamplingParams(max_tokens=50))
        kept = engine.add("kept", [1], SamplingParams(max_tokens=6))
        with pytest.raises(ReplicaUnavailable, match="model replica 1 failed") as err:
            async for _ in lost:
                pass
        assert isinstance(err.value, EngineFailed)
        assert [o async for o in kept][-1].outputs[0].token_ids == [0, 1, 2, 3, 4, 5]
        assert not fatal and engine.running
        late = engine.add("late", [1], SamplingParams(max_tokens=2))
        assert [o async for o in late][-1].finished
        await engine.shutdown()

    asyncio.run(main())
