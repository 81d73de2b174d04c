"""Incremental detokenization that never splits a multi-byte character (invariant 8).

Decoding token by token is wrong for byte-level BPE (a character may span tokens) and
for tokenizers whose spacing depends on the previous token. We decode a short window of
tokens: the text of window[:read] is already emitted (it is context); the text of the
whole window minus that is the new part, held back while it ends in an incomplete UTF-8
sequence.

With a Hugging Face fast tokenizer the `tokenizers` library's `DecodeStream` does the same
window arithmetic natively (one call per step instead of two decodes from Python; 1.4 to
1.7x less host time for detokenization, docs/benchmarks/output_cost.md). We keep the window's tokens beside
it, so `flush` and the Python path can take over at any point, and the text is the Python
path's delta for delta; a request falls back to the Python path where the stream could
disagree:
- the prompt's context tail decodes to an incomplete character (the stream would then emit
  the context's text too);
- more than CONTEXT_TOKENS tokens come out at once (the Python path then trims its context;
  the stream is restarted on the trimmed context instead);
- the stream reports that a window's text does not extend the emitted prefix (a decoder
  whose text of earlier tokens changes with later ones).
One case can still differ, and only for such decoders: a window whose text is not an
extension of the prefix and is not longer in bytes (the stream holds it back; the Python
path would emit a slice of mismatched text).
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from kvloom.cluster.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
# Tokens of context kept before the unemitted ones, so spacing decodes as in full text.
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """`push(ids)` returns the newly complete text; `flush()` the held-back rest at end.
    `native=False` forces the Python window path (tests compare the two)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        native: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # The window: context tokens (already emitted, or the prompt's tail), then held ones.
        self.window = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.read_offset = len(self.window)
        self.text = ""
        # None: the Python path, for good. Duck-typed tokenizers (test doubles) may lack the
        # attribute. The stream starts at the first push: nothing is decoded before then
        # (the engine validates the prompt's ids after this is made).
        self._backend = getattr(tokenizer, "hf_tokenizer", None) if native else None
        self._stream: DecodeStream | None = None

    @property
    def uses_native_stream(self) -> bool:
        """Whether pushes go (or, before the first, will try to go) to the native stream."""
        return self._backend is not None

    def _start_stream(self) -> None:
        if self._decode(self.window).endswith(REPLACEMENT):
            self._backend = None  # the stream would emit the context's text: Python path
        else:
            self._stream = DecodeStream(self.window, self.skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_token_ids: list[int]) -> str:
        """Adds tokens; returns the newly complete text (possibly empty)."""
        count = len(new_token_ids)
        if self._stream is None:
            if self._backend is not None and count:
                self._start_stream()
            if self._stream is None:
                return self._push_window(new_token_ids)
        if count == 0:
            return ""
        stream = self._stream
        self.window.extend(new_token_ids)
        try:
            # A plain int is the common decode step, and half the cost of a one-item list.
            step_ids = new_token_ids[0] if count == 1 else list(new_token_ids)
            delta = stream.step(self._backend, step_ids)
        except Exception:  # the stream's prefix check failed: the Python path decides
            self._stream = self._backend = None
            del self.window[len(self.window) - len(new_token_ids) :]
            return self._push_window(new_token_ids)
        if delta is None:
            return ""
        if self._advance(delta):
            # The window path trimmed its context: restart the stream on the same tokens.
            self._stream = None
            self._start_stream()
        return delta

    def _advance(self, delta: str) -> bool:
        """Moves the window past emitted text, dropping the tokens before it; True when it
        kept fewer than all the tokens just emitted as context (the native stream keeps
        them all, so it must be restarted)."""
        read = self.read_offset
        start = max(read, len(self.window) - CONTEXT_TOKENS)
        del self.window[:start]
        self.read_offset = len(self.window)
        self.text += delta
        return start != read

    def _push_window(self, new_token_ids: list[int]) -> str:
        self.window.extend(new_token_ids)
        prefix_text = self._decode(self.window[: self.read_offset])
        full_text = self._decode(self.window)
        if full_text.endswith(REPLACEMENT) or len(full_text) <= len(prefix_text):
            return ""  # an incomplete character: wait for the next token
        delta = full_text[len(prefix_text) :]
        self._advance(delta)
        return delta

    def flush(self) -> str:
        """At end of stream: emits whatever is held back (as the tokenizer decodes it)."""
        if self.read_offset == len(self.window):
            return ""
        prefix_text = self._decode(self.window[: self.read_offset])
        full_text = self._decode(self.window)
        delta = full_text[len(prefix_text) :]
        self.read_offset = len(self.window)
        self.text += delta
        self._stream = self._backend = None  # its window is behind: later pushes are Python's
        return delta
