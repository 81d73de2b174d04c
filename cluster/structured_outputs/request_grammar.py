"""One request's matcher: the mask its next token must fall in, and the tokens it took."""

from __future__ import annotations

import numpy as np


class RequestGrammar:
    """Wraps an xgrammar GrammarMatcher. The bitmask is xgrammar's layout (int32 words,
    bit j of word i allows token 32 * i + j), sent to the workers as bytes."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)
        self._xgrammar = xgrammar
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def next_token_bitmask(self) -> bytes:
        self.matcher.fill_next_token_bitmask(self._bitmask)
        return np.ascontiguousarray(self._bitmask.numpy()[0]).tobytes()

    def valid_draft_prefix(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar allows (the matcher is left unchanged).
        Drafts after a completed grammar are cut too: nothing follows its stop token."""
        accepted = 0
        for token_id in drafts:
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(token_id)):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return accepted

    def draft_bitmasks(self, drafts: list[int]) -> bytes:
        """The masks of a step verifying these (grammar-valid) drafts: one per lane, the
        next token's and then the one after each draft, concatenated."""
        masks = [self.next_token_bitmask()]
        for token_id in drafts:
            self.matcher.accept_token(int(token_id))
            masks.append(self.next_token_bitmask())
        if drafts:
            self.matcher.rollback(len(drafts))
        return b"".join(masks)

    def accept(self, token_id: int) -> bool:
        """False when the grammar does not allow this token (the matcher is unchanged)."""
        return bool(self.matcher.accept_token(int(token_id)))

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: the output is complete."""
        return bool(self.matcher.is_terminated())
