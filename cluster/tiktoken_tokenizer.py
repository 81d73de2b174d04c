"""Tokenizers shipped as a tiktoken vocabulary (Kimi K2, Kimi-Linear), through `tiktoken`.

The layout (Moonshot's `tokenization_kimi.py`, which such repositories name in auto_map):
  * `tiktoken.model`: one `<base64 token bytes> <rank>` line per byte-level BPE token; a
    token's id is its rank, and ranks run 0 .. n-1.
  * `tokenizer_config.json`: `added_tokens_decoder` names the special tokens, whose ids
    follow the ranks; Kimi reserves 256 + 2 ids there, and an id it does not name is
    `<|reserved_token_ID|>`. bos_token / eos_token / chat_template as usual.
  * The pre-tokenizer pattern is not in any file: Kimi's (below) unless tokenizer_config
    carries a `pat_str`.

As Kimi's Hugging Face tokenizer does, special-token text in the input (what chat templates
write) encodes to the special ids, no BOS is prepended unless `add_bos_token` is true, and
decoding with skip_special_tokens drops the tokens marked special (plain added tokens such
as `<think>` stay, for the reasoning and tool-call parsers).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterator
from pathlib import Path

import tiktoken

from kvloom.cluster.tokenizer import TIKTOKEN_MODEL, Tokenizer

# Ids after the BPE ranks kept for special tokens (tokenization_kimi.py: 256 reserved + 2).
NUM_SPECIAL_SLOTS = 256 + 2

# Kimi's split: runs of Han characters apart; words with optional leading punctuation and
# English contractions, split where case changes (two alternatives); up to 3 digits;
# punctuation runs; newlines; other whitespace. `&&` is a class intersection (fancy-regex).
_LETTERS_NOT_HAN = r"\p{Lo}\p{M}&&[^\p{Han}]"
KIMI_PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}" + _LETTERS_NOT_HAN + r"]*"
        r"[\p{Ll}\p{Lm}" + _LETTERS_NOT_HAN + r"]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}" + _LETTERS_NOT_HAN + r"]+"
        r"[\p{Ll}\p{Lm}" + _LETTERS_NOT_HAN + r"]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

# tiktoken's regex backtracks badly on very long runs of (non-)whitespace, and panics on
# huge inputs; Kimi's tokenizer cuts the text at these lengths, and so do we.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
_RUNS = re.compile(r"\s+|\S+")


def read_ranks(path: Path) -> dict[bytes, int]:
    """`tiktoken.model` lines -> {token bytes: rank}; a bad line raises naming its number."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("expected '<base64 token> <rank>'")
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error) as err:
            raise ValueError(f"{path.name} line {number}: {err}") from None
        if token in ranks:
            raise ValueError(f"{path.name} line {number}: token {token!r} listed twice")
        ranks[token] = rank
    if not ranks:
        raise ValueError(f"{path.name} holds no tokens")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path.name}: ranks must be 0 .. {len(ranks) - 1}, each once")
    return ranks


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (how byte-level BPE vocabularies spell
    tokens, used by id_to_token)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _slices(text: str) -> Iterator[str]:
    """The text cut so that no piece exceeds MAX_ENCODE_CHARS and no run of whitespace or
    non-whitespace inside a piece exceeds MAX_RUN_CHARS."""
    for offset in range(0, len(text), MAX_ENCODE_CHARS):
        chunk = text[offset : offset + MAX_ENCODE_CHARS]
        start = 0
        for run in _RUNS.finditer(chunk):
            cut = run.start() + MAX_RUN_CHARS
            while cut < run.end():
                yield chunk[start:cut]
                start, cut = cut, cut + MAX_RUN_CHARS
        yield chunk[start:]


class TiktokenTokenizer(Tokenizer):
    """A `tiktoken.model` vocabulary with tokenizer_config.json's special tokens."""

    def _load(self, model_dir: Path) -> None:
        ranks = read_ranks(model_dir / TIKTOKEN_MODEL)
        num_base = self.num_base_tokens = len(ranks)
        added = self.config.get("added_tokens_decoder") or {}
        if not isinstance(added, dict):
            raise ValueError("tokenizer_config.json added_tokens_decoder must be an object")
        named: dict[int, dict] = {}
        for key, entry in added.items():
            content = entry.get("content") if isinstance(entry, dict) else None
            if not str(key).isdigit() or not isinstance(content, str):
                raise ValueError(
                    f"tokenizer_config.json added_tokens_decoder[{key!r}] must map an id to "
                    '{"content": ..., "special": ...}'
                )
            if int(key) < num_base:
                raise ValueError(
                    f"tokenizer_config.json added_tokens_decoder[{key!r}]: id falls inside "
                    f"{TIKTOKEN_MODEL}'s {num_base} ranks"
                )
            named[int(key)] = entry
        end = max(num_base + NUM_SPECIAL_SLOTS, max(named, default=0) + 1)
        self.special_tokens = {
            named[i]["content"] if i in named else f"<|reserved_token_{i}|>": i
            for i in range(num_base, end)
        }
        if len(self.special_tokens) != end - num_base:
            raise ValueError("tokenizer_config.json added_tokens_decoder names a token twice")
        # Reserved slots count as special (never shown); named ones say for themselves.
        self.special_ids = {
            i for i in range(num_base, end) if i not in named or named[i].get("special", True)
        }
        pattern = self.config.get("pat_str") or KIMI_PAT_STR
        try:
            self._enc = tiktoken.Encoding(
                name=str(model_dir / TIKTOKEN_MODEL),
                pat_str=pattern,
                mergeable_ranks=ranks,
                special_tokens=self.special_tokens,
            )
        except ValueError as err:
            raise ValueError(f"tokenizer_config.json pat_str: {err}") from None
        self._byte_chars = _bytes_to_unicode()

    @property
    def vocab_size(self) -> int:
        return self._enc.n_vocab

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) <= MAX_RUN_CHARS:
            ids = self._enc.encode(text, allowed_special="all")
        else:
            ids = [
                i for piece in _slices(text) for i in self._enc.encode(piece, allowed_special="all")
            ]
        bos = self.bos_token_id
        if add_special_tokens and self.config.get("add_bos_token") is True and bos is not None:
            ids.insert(0, bos)
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in token_ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self._enc.decode(ids)  # errors="replace": a split character shows as U+FFFD

    def id_to_token(self, token_id: int) -> str | None:
        if not 0 <= token_id < self._enc.n_vocab:
            return None
        raw = self._enc.decode_single_token_bytes(token_id)
        if token_id >= self.num_base_tokens:  # special: its own text
            return raw.decode("utf-8")
        return "".join(self._byte_chars[b] for b in raw)

    def token_to_id(self, token: str) -> int | None:
        if token in self.special_tokens:
            return self.special_tokens[token]
        try:
            return self._enc.encode_single_token(token.encode("utf-8"))
        except KeyError:
            return None
