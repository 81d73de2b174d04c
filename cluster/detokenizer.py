"""Incremental detokenization that never splits a multi-byte character (invariant 8).

Decoding token by token is wrong for byte-level BPE (a character may span tokens) and
for tokenizers whose spacing depends on the previous token. We decode a short window:
the text of tokens[prefix:read] is already emitted; the text of tokens[prefix:] minus
that is the new part, held back while it ends in an incomplete UTF-8 sequence.
"""

from __future__ import annotations

from kvloom.cluster.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
# Tokens of context kept before the unemitted ones, so spacing decodes as in full text.
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_token_ids: list[int]) -> str:
        """Adds tokens; returns the newly complete text (possibly empty)."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if full_text.endswith(REPLACEMENT) or len(full_text) <= len(prefix_text):
            return ""  # an incomplete character: wait for the next token
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = max(self.read_offset, len(self.token_ids) - CONTEXT_TOKENS)
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At end of stream: emits whatever is held back (as the tokenizer decodes it)."""
        if self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        delta = full_text[len(prefix_text) :]
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta
