"""The front door <-> scheduler actor codec: deltas rebuild exactly the cumulative outputs
the engine made, through msgpack, including text the engine revised (cut at a stop)."""

from __future__ import annotations

import msgspec

from kvloom.cluster.engine_channel import Events, OutputDecoder, OutputEncoder
from kvloom.cluster.outputs import CompletionOutput, Logprob, RequestOutput


def output(text, ids, finished=False, logprobs=True):
    lps = [{t: Logprob(-0.5 * t, 1)} for t in ids] if logprobs else None
    reason = "stop" if finished else None
    completion = CompletionOutput(0, text, list(ids), -1.0, lps, finish_reason=reason)
    return RequestOutput("r", None, [1, 2], [completion], finished, num_cached_tokens=4)


def test_deltas_rebuild_the_cumulative_outputs():
    steps = [
        output("He", [7]),
        output("Hello", [7, 8]),
        output("Hello wo", [7, 8, 9]),
        output("Hello", [7, 8, 9, 10], finished=True),  # the text cut back at a stop string
    ]
    encoder, decoder = OutputEncoder(), OutputDecoder()
    decoder.start("r", [1, 2])
    wire = msgspec.msgpack.Decoder(Events)
    rebuilt, deltas = [], []
    for out in steps:
        delta = encoder.delta(out)
        deltas.append(delta)
        events = wire.decode(msgspec.msgpack.encode(Events(deltas=[delta])))
        rebuilt.append(decoder.apply(events.deltas[0]))
    assert rebuilt == steps
    # Each step carried only what it added; the revision restarts at the common prefix.
    assert [(d.tokens_from, d.token_ids) for d in deltas] == [
        (0, [7]),
        (1, [8]),
        (2, [9]),
        (3, [10]),
    ]
    assert [(d.text_from, d.text) for d in deltas] == [(0, "He"), (2, "llo"), (5, " wo"), (5, "")]
    assert decoder.apply(deltas[0]) is None  # finished: the decoder forgot the request


def test_a_delta_of_a_request_the_front_door_dropped_is_ignored():
    decoder = OutputDecoder()
    assert decoder.apply(OutputEncoder().delta(output("x", [3]))) is None
