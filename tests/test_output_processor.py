"""The one output path (cluster/output_processor.py): engine-core outputs (token ids) in,
per-step deltas (front doors) or cumulative RequestOutputs (Engine.step) out; stop strings
held back while they may start, matched once, and aborted in the core at once."""

from __future__ import annotations

import pytest

from kvloom import SamplingParams
from kvloom.cluster.output_processor import OutputProcessor
from kvloom.cluster.outputs import EngineCoreOutput
from kvloom.cluster.tokenizer import Tokenizer


class CharTokenizer:
    """Token id i decodes to PIECES[i] (ids past the table: nothing)."""

    PIECES = ["", "a", "b", "S", "T", "O", "P", "x", " ", "hi"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.PIECES[i] if i < len(self.PIECES) else "" for i in ids)


A, B, S, T, OH, P, X, SPACE, HI = range(1, 10)


def core(rid, ids, reason=None, stop=None, logprobs=None, by_stop_token=False):
    return EngineCoreOutput(
        rid, list(ids), logprobs, reason, stop, ended_by_stop_token=by_stop_token
    )


def processor_with(rid="r", **params) -> OutputProcessor:
    processor = OutputProcessor(CharTokenizer())
    processor.add_request(rid, [20, 21], SamplingParams(**params))
    return processor


def test_a_stop_string_prefix_is_held_back_and_flushed_with_the_finish():
    processor = processor_with(stop=["STOP"])
    texts = []
    for ids in ([A, B], [S], [T], [OH, X]):  # "STOx" is no stop: all of it goes
        (delta,) = processor.process([core("r", ids)]).outputs
        texts.append(delta.text)
    assert texts == ["ab", "", "", "STOx"]
    processor = processor_with(stop=["STOP"])
    processor.process([core("r", [A, S, T])])
    (final,) = processor.process([core("r", [OH], "length")]).outputs
    assert final.text == "STO" and final.finished and final.completion_tokens == 4  # invariant 8


def test_a_matched_stop_string_ends_the_request_and_asks_the_core_to_abort_it():
    processor = processor_with(stop=["STOP"])
    first = processor.process([core("r", [HI, SPACE, S, T])])
    assert first.outputs[0].text == "hi " and first.stopped == []
    step = processor.process([core("r", [OH, P, X])])
    (final,) = step.outputs
    assert step.stopped == ["r"]  # the caller aborts it in the engine core now
    assert (final.text, final.finish_reason, final.stop_reason) == ("", "stop", "STOP")
    assert final.finished and final.token_ids == [OH, P, X]
    # What the core still sends for it (a step already in flight) is dropped.
    assert processor.process([core("r", [A])]).outputs == []
    assert not processor.has_unfinished_requests()


def test_a_stop_string_completed_by_the_last_step_overrides_the_cores_reason():
    processor = processor_with(stop=["ab"], include_stop_str_in_output=True)
    step = processor.process([core("r", [X, A, B], "length")])
    (final,) = step.outputs
    assert step.stopped == []  # the core has ended it already
    assert (final.text, final.finish_reason, final.stop_reason) == ("xab", "stop", "ab")


def test_the_eos_or_stop_token_is_not_text():
    processor = processor_with()
    (final,) = processor.process([core("r", [A, HI], "stop", HI, by_stop_token=True)]).outputs
    assert final.text == "a" and final.token_ids == [A, HI] and final.stop_reason == HI


def test_deltas_carry_each_token_and_logprob_once_and_cumulative_outputs_all():
    processor = processor_with(logprobs=1)
    (first,) = processor.process([core("r", [A], logprobs=[(-0.1, 1, [(A, -0.1)])])]).outputs
    (second,) = processor.process(
        [core("r", [B, X], logprobs=[(-0.2, 1, [(B, -0.2)]), (-0.3, 2, [(A, -0.1)])])]
    ).outputs
    assert (first.token_ids, second.token_ids, second.text) == ([A], [B, X], "bx")
    assert [sorted(e) for e in second.logprobs] == [[B], [A, X]]
    assert second.logprobs[1][X].rank == 2 and second.logprobs[1][A].rank == 1
    assert abs(second.cumulative_logprob + 0.6) < 1e-12
    # The same steps in cumulative mode (Engine.step): everything so far, each time.
    processor = processor_with(logprobs=1)
    processor.process([core("r", [A], logprobs=[(-0.1, 1, [])])], cumulative=True)
    (out,) = processor.process(
        [core("r", [B], "length", logprobs=[(-0.2, 1, [])])], cumulative=True
    ).outputs
    completion = out.outputs[0]
    assert (completion.token_ids, completion.text, completion.finish_reason) == (
        [A, B],
        "ab",
        "length",
    )
    assert len(completion.logprobs) == 2 and out.prompt_token_ids == [20, 21]


def test_final_only_requests_get_no_cumulative_output_until_they_finish():
    processor = processor_with(output_kind="final_only")
    assert processor.process([core("r", [A])], cumulative=True).outputs == []
    (out,) = processor.process([core("r", [B], "length")], cumulative=True).outputs
    assert out.finished and out.outputs[0].text == "ab"


def test_abort_flushes_the_detokenizers_utf8_hold_back(demo_tokenizer_dir):
    """The last token is half of a character: its bytes are held back while streaming; the
    abort's final delta carries them (as the tokenizer decodes them)."""
    tokenizer = Tokenizer(demo_tokenizer_dir)
    euro = tokenizer.encode("€", add_special_tokens=False)
    assert len(euro) == 3  # three byte tokens: the first two are incomplete UTF-8
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", tokenizer.encode("Price: "), SamplingParams())
    five = tokenizer.encode(" 5", add_special_tokens=False)
    texts = [processor.process([core("r", ids)]).outputs[0].text for ids in (five, euro[:2])]
    assert texts == [" 5", ""]  # the half character is held back
    (final,) = processor.abort(["r", "unknown"])
    assert final.finished and final.finish_reason == "abort" and final.token_ids == []
    assert final.text and final.completion_tokens == len(five) + 2
    assert processor.abort(["r"]) == []


def test_a_streaming_processor_keeps_no_logprob_history():
    processor = OutputProcessor(CharTokenizer(), keep_history=False)
    processor.add_request("r", [20], SamplingParams(logprobs=0))
    steps = [[(-0.1, 1, [])], [(-0.2, 1, []), (-0.3, 1, [])], [(-0.4, 1, [])]]
    got = []
    for ids, raw in zip(([A], [B, X], [A]), steps):
        (delta,) = processor.process([core("r", ids, logprobs=raw)]).outputs
        got.append(
            [(tid, entry[tid].logprob) for tid, entry in zip(delta.token_ids, delta.logprobs)]
        )
        assert len(processor.states["r"].logprobs) == len(ids)  # this step's only
    assert got == [[(A, -0.1)], [(B, -0.2), (X, -0.3)], [(A, -0.4)]]
    (final,) = processor.abort(["r"])
    assert final.logprobs == [] and abs(final.cumulative_logprob + 1.0) < 1e-12
    with pytest.raises(RuntimeError, match="keep_history"):
        processor.process([], cumulative=True)
