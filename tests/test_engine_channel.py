"""The front door <-> scheduler actor messages: engine-core outputs cross as the core
emits them (a step's new ids and raw logprobs, never text or history), through msgpack."""

from __future__ import annotations

import msgspec

from kvloom.cluster.engine_channel import AbortRequests, Commands, Events
from kvloom.cluster.outputs import EngineCoreOutput


def test_core_outputs_cross_the_channel_unchanged_and_carry_only_the_step():
    steps = [
        EngineCoreOutput("r", [7], [(-0.5, 1, [(7, -0.5), (3, -1.5)])], num_cached_tokens=4),
        EngineCoreOutput("r", [8, 9], None, num_cached_tokens=4),
        EngineCoreOutput(
            "r",
            [10],
            None,
            "stop",
            10,
            ended_by_stop_token=True,
            num_cached_tokens=4,
            metrics={"ttft_s": 0.25},
        ),
    ]
    wire = msgspec.msgpack.Decoder(Events)
    for out in steps:
        encoded = msgspec.msgpack.encode(Events(outputs=[out]))
        assert wire.decode(encoded).outputs == [out]
    assert steps[-1].finished and not steps[0].finished


def test_a_stop_string_abort_says_so():
    wire = msgspec.msgpack.Decoder(Commands)
    sent = Commands([AbortRequests(["a", "b"], stopped=True), AbortRequests(["c"])])
    assert wire.decode(msgspec.msgpack.encode(sent)) == sent
