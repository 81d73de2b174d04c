"""Tokenizers in Kimi's tiktoken layout (`tiktoken.model` + tokenizer_config.json special
tokens, no tokenizer.json): encode/decode, special tokens, streaming detokenization that
never splits a character, the chat template, and a Kimi-Linear demo model served with one.

The tokenizer here is written by hand: the 256 single bytes, then a few hundred merges
(every prefix of a word list, multi-byte characters among them), then Kimi's 258 special
ids of which tokenizer_config names a few.
"""

from __future__ import annotations

import base64
import json
import pickle
import random

import pytest

from kvloom.cluster.chat_template import ChatTemplate
from kvloom.cluster.detokenizer import IncrementalDetokenizer
from kvloom.cluster.tiktoken_tokenizer import NUM_SPECIAL_SLOTS, TiktokenTokenizer, _slices
from kvloom.cluster.tokenizer import Tokenizer

WORDS = [
    "hello", " hello", " world", "Hello", " the", " and", " token", " stream", "ing",
    " kimi", " linear", " attention", "er", "ed", " is", " a", " of", " to", "\n\n",
    "  ", "123", "12", "é", " café", "ü", " über", "漢字", "日本", "中", "🎉",
    "字a",  # spans a Han/Latin boundary: Kimi's pattern splits there, so never used
]  # fmt: skip
SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>"]
SPECIALS += ["<|im_system|>", "<|im_middle|>"]
PLAIN_ADDED = ["<think>", "</think>"]  # added but not special: kept in decoded text
TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif m.role == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ m.content }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
TEXTS = [
    "hello world",
    "Hello, café über alles: 漢字 and 日本語 🎉🎉 done.\n\nnext line",
    "  spaced   out\ttabs\r\nand 12345 numbers",
    "emoji 👩‍👩‍👧 zwj, combining é, rtl שלום, math ∑∫",
]


def write_tokenizer(out, pat_str: str | None = None):
    ranks = [bytes([b]) for b in range(256)]
    for word in WORDS:
        data = word.encode("utf-8")
        for end in range(2, len(data) + 1):
            if data[:end] not in ranks:
                ranks.append(data[:end])
    (out / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks))
    )
    base = len(ranks)
    added = {
        str(base + i): {"content": text, "special": text in SPECIALS}
        for i, text in enumerate(SPECIALS + PLAIN_ADDED)
    }
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "added_tokens_decoder": added,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "chat_template": TEMPLATE,
    }
    if pat_str is not None:
        config["pat_str"] = pat_str
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": base + 2}))
    return out, ranks


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tiktoken-tok"))


@pytest.fixture(scope="module")
def tok(written):
    return Tokenizer(written[0])


def test_layout(tok, written):
    _, ranks = written
    base = len(ranks)
    assert 300 < base < 600  # a few hundred ranks
    assert isinstance(tok, TiktokenTokenizer)
    copy = pickle.loads(pickle.dumps(tok))  # e.g. sent to a render worker
    assert isinstance(copy, TiktokenTokenizer) and copy.encode(TEXTS[1]) == tok.encode(TEXTS[1])
    assert tok.vocab_size == base + NUM_SPECIAL_SLOTS
    assert tok.bos_token_id == base and tok.token_to_id("[EOS]") == base + 1
    assert tok.eos_token_ids == (base + 2,)  # generation_config.json wins
    assert tok.special_ids >= {base + i for i in range(len(SPECIALS))}
    assert base + len(SPECIALS) not in tok.special_ids  # <think> is not special
    assert tok.id_to_token(ranks.index(b" hello")) == "\u0120hello"  # byte-level spelling
    assert tok.id_to_token(base + 3) == "<|im_user|>"
    last = base + NUM_SPECIAL_SLOTS - 1
    assert tok.id_to_token(last) == f"<|reserved_token_{last}|>"


def test_round_trip_with_multibyte_characters(tok, written):
    _, ranks = written
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(0 <= i < len(ranks) for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode(" hello") == [ranks.index(b" hello")]  # merges are used
    assert tok.encode("é") == [ranks.index("é".encode())]
    # Kimi's pattern puts Han runs in their own piece: the 字a merge never applies.
    ids = tok.encode("字abc")
    assert ranks.index("字a".encode()) not in ids
    assert tok.decode(ids[:1]) == "字"


def test_pattern_from_tokenizer_config(tmp_path):
    """A `pat_str` in tokenizer_config replaces Kimi's: here one that keeps letters of any
    script together, so the 字a merge applies."""
    out, ranks = write_tokenizer(tmp_path, pat_str=r"\p{L}+|\p{N}+|\s+|[^\s\p{L}\p{N}]+")
    ids = Tokenizer(out).encode("字abc")
    assert ranks.index("字a".encode()) in ids


def test_special_tokens(tok, written):
    _, ranks = written
    base = len(ranks)
    text = "<|im_user|>user<|im_middle|>hello<|im_end|><think>hm</think>"
    ids = tok.encode(text)
    assert ids[0] == base + 3 and ids[-1] == base + len(SPECIALS) + 1
    assert base + 2 in ids and base + 6 in ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "userhello<think>hm</think>"
    reserved = base + NUM_SPECIAL_SLOTS - 1
    assert tok.decode([reserved], skip_special_tokens=False) == f"<|reserved_token_{reserved}|>"
    assert tok.decode([ranks.index(b"hello"), reserved]) == "hello"
    assert tok.encode("hello", add_special_tokens=True) == [ranks.index(b"hello")]  # no BOS


def stream(tok, ids, chunks) -> tuple[str, list[str]]:
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    deltas, start = [], 0
    for size in chunks:
        deltas.append(detok.push(ids[start : start + size]))
        start += size
    assert start == len(ids)
    deltas.append(detok.flush())
    return "".join(deltas), deltas


def test_streaming_never_splits_a_character(tok, written):
    _, ranks = written
    for text in TEXTS:
        # Every byte its own token: each byte boundary is a token boundary.
        byte_ids = [ranks.index(bytes([b])) for b in text.encode("utf-8")]
        whole, deltas = stream(tok, byte_ids, [1] * len(byte_ids))
        assert whole == text
        assert not any("\ufffd" in d for d in deltas)
        # The tokenizer's own ids, one at a time and in random chunks.
        ids = tok.encode(text)
        assert stream(tok, ids, [1] * len(ids))[0] == text
        rng = random.Random(len(text))
        for _ in range(5):
            chunks, left = [], len(ids)
            while left:
                chunks.append(min(left, rng.randint(1, 4)))
                left -= chunks[-1]
            assert stream(tok, ids, chunks)[0] == text
        # A prompt's tail as context: only the completion's text comes out.
        prompt = byte_ids[:7]
        detok = IncrementalDetokenizer(tok, prompt)
        out = "".join(detok.push([i]) for i in byte_ids[7:]) + detok.flush()
        assert out == text.encode("utf-8")[7:].decode("utf-8", "replace").lstrip("\ufffd")


def test_chat_template_renders_to_special_ids(tok, written):
    out, ranks = written
    template = ChatTemplate.from_model_dir(out)
    rendered = template.render(
        [{"role": "user", "content": "hello café"}], add_generation_prompt=True
    )
    assert rendered.text == "<|im_user|>user<|im_middle|>hello café<|im_end|>" + (
        "<|im_assistant|>assistant<|im_middle|>"
    )
    ids = tok.encode(rendered.text, add_special_tokens=False)
    base = len(ranks)
    assert [i for i in ids if i >= base] == [base + 3, base + 6, base + 2, base + 4, base + 6]
    assert tok.decode(ids, skip_special_tokens=False) == rendered.text


def test_long_runs_are_cut_and_round_trip(tok):
    text = "a" * 30_000 + " " * 26_000 + "漢字" * 13_000
    pieces = list(_slices(text))
    assert "".join(pieces) == text and len(pieces) > 2
    assert tok.decode(tok.encode(text)) == text


def test_bad_files_are_named(tmp_path):
    out, ranks = write_tokenizer(tmp_path)
    lines = (out / "tiktoken.model").read_text().splitlines()
    lines[5] = "not-base64!! 5"
    (out / "tiktoken.model").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="tiktoken.model line 6"):
        Tokenizer(out)
    write_tokenizer(tmp_path)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["7"] = {"content": "<x>", "special": True}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"added_tokens_decoder\['7'\]"):
        Tokenizer(out)
    (out / "tiktoken.model").unlink()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer(out)


@pytest.fixture(scope="module")
def kimi_demo(tmp_path_factory):
    from kvloom.cluster.demo_model import write_demo_model

    out = tmp_path_factory.mktemp("kimi-tiktoken")
    return write_demo_model(out, arch="kimi_linear", tokenizer_format="tiktoken")


def test_kimi_linear_demo_with_tiktoken_tokenizer_generates(kimi_demo):
    from kvloom import LLM, Engine, SamplingParams

    assert (kimi_demo / "tiktoken.model").is_file()
    assert not (kimi_demo / "tokenizer.json").exists()
    config = json.loads((kimi_demo / "config.json").read_text())
    llm = LLM(str(kimi_demo), dtype="float32", progress=False)
    tok = llm.get_tokenizer()
    assert isinstance(tok, TiktokenTokenizer) and tok.vocab_size == config["vocab_size"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    out = llm.chat([{"role": "user", "content": "Hello, 漢字 🎉"}], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.token_ids) == 12
    assert completion.text == tok.decode(completion.token_ids)
    prompt_ids = out.prompt_token_ids
    assert tok.token_to_id("<|im_start|>") in prompt_ids  # the template's markers
    assert tok.decode(prompt_ids, skip_special_tokens=False).startswith("<|im_start|>user\n")

    engine = Engine(model=str(kimi_demo), dtype="float32", progress=False)
    assert isinstance(engine.tokenizer, TiktokenTokenizer)
    text_out = llm.generate(["Hello wörld"], params, use_tqdm=False)[0]
    assert text_out.prompt_token_ids == tok.encode("Hello wörld")
    assert len(text_out.outputs[0].token_ids) == 12
