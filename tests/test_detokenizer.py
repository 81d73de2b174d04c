"""cluster/detokenizer.py: the native `DecodeStream` path gives exactly the Python window
path's text, delta by delta, and never splits a multi-byte character (invariant 8)."""

from __future__ import annotations

import random

import pytest

from kvloom.cluster.detokenizer import IncrementalDetokenizer
from kvloom.cluster.tokenizer import Tokenizer

TEXTS = ["héllo wörld", "emoji 😀🎉 and 中文字符", "<think>a</think> €5 <|im_end|> ok", "ÿ\u00a0—"]


@pytest.fixture(scope="module")
def tok(demo_tokenizer_dir) -> Tokenizer:
    return Tokenizer(demo_tokenizer_dir)


def run(tok, prompt, chunks, skip, native):
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip, native=native)
    deltas = [detok.push(chunk) for chunk in chunks]
    detok.native_until_flush = detok.uses_native_stream
    return deltas + [detok.flush()], detok


def random_case(rng: random.Random, tok: Tokenizer, text_ids: list[list[int]]):
    """A prompt and chunks: random vocabulary ids (partial UTF-8 bytes, specials, added
    tokens) mixed with runs of real multi-byte text, in chunks of 0 to 8 tokens."""

    def ids(n):
        out = []
        while len(out) < n:
            if rng.random() < 0.3:
                out.extend(rng.choice(text_ids))
            else:
                out.append(rng.randrange(tok.vocab_size))
        return out[:n]

    prompt = ids(rng.randint(0, 8))
    output = ids(rng.randint(0, 40))
    chunks, start = [], 0
    while start < len(output):
        size = rng.choice([0, 1, 1, 1, 2, 3, 6, 8])
        chunks.append(output[start : start + size])
        start += size
    return prompt, chunks


def test_native_and_python_paths_agree_at_every_step(tok):
    rng = random.Random(19)
    text_ids = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    native_runs = 0
    for case in range(400):
        prompt, chunks = random_case(rng, tok, text_ids)
        skip = case % 2 == 0
        native, native_detok = run(tok, prompt, chunks, skip, native=True)
        python, _ = run(tok, prompt, chunks, skip, native=False)
        assert native == python, (prompt, chunks, skip)
        assert native_detok.text == "".join(python)
        native_runs += native_detok.native_until_flush
    print("cases native to the end:", native_runs)
    assert native_runs >= 200  # most cases ran on the native stream throughout


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_never_splits_a_character(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    deltas, detok = run(tok, [], [[i] for i in ids], skip=False, native=True)
    assert detok.native_until_flush  # ran on the native stream
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=False) == text
    assert not any("\ufffd" in d for d in deltas)


def test_held_back_bytes_are_flushed_at_end(tok):
    detok = IncrementalDetokenizer(tok, tok.encode("price:", add_special_tokens=False))
    assert detok.uses_native_stream
    # An incomplete character is held back, then flushed as the tokenizer decodes it.
    partial = tok.encode("😀", add_special_tokens=False)
    assert len(partial) > 1
    assert detok.push(partial[:-1]) == ""
    assert detok.flush() == tok.decode(partial[:-1])
    assert detok.text.endswith("\ufffd")


def test_a_prompt_tail_ending_mid_character_uses_the_python_path(tok):
    emoji = tok.encode("😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, emoji[:-1])
    python = IncrementalDetokenizer(tok, emoji[:-1], native=False)
    rest = [emoji[-1], *tok.encode(" ok", add_special_tokens=False)]
    assert [detok.push([i]) for i in rest] == [python.push([i]) for i in rest]
    assert not detok.uses_native_stream  # decided at the first push


def test_nothing_is_decoded_before_the_first_push(tok):
    # The engine checks a prompt's ids after its output state is made.
    detok = IncrementalDetokenizer(tok, [1, "x"])  # type: ignore[list-item]
    assert detok.uses_native_stream and detok.flush() == ""


def test_a_tokenizer_without_native_decoding_uses_the_python_path(tok):
    class Plain:
        def decode(self, ids, skip_special_tokens=True):
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode(TEXTS[1], add_special_tokens=False)
    plain, detok = run(Plain(), [], [[i] for i in ids], skip=True, native=True)
    assert not detok.uses_native_stream and "".join(plain) == TEXTS[1]


def test_a_stream_error_falls_back_to_the_python_path_for_the_same_text(tok):
    class Refusing:
        def step(self, tokenizer, ids):
            raise Exception("Invalid prefix encountered")

    ids = tok.encode(TEXTS[1], add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, ids[:3])
    python = IncrementalDetokenizer(tok, ids[:3], native=False)
    expected = [python.push([i]) for i in ids[3:]]
    deltas = [detok.push([i]) for i in ids[3:6]]
    detok._stream = Refusing()  # as a decoder whose earlier text changes would
    deltas += [detok.push([i]) for i in ids[6:]]
    assert deltas == expected and not detok.uses_native_stream
