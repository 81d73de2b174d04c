"""Prompt-lookup n-gram drafting: propose the tokens that followed the most recent earlier
occurrence of the request's last n tokens (n from max_n down to min_n).

Deterministic and model-free. It runs on the worker, from the worker's copy of the
token history (the scheduler's tokens and the ones the worker itself just emitted), so a
step scheduled before the previous one's tokens are back (async scheduling) still gets
real drafts, and n-gram and model drafters share one path. A match near the end of the
sequence has fewer than k tokens after it; with `extend_periodic` the proposal continues
through its own tokens (as LZ77 copies overlap), which is what the text does if the repeat
goes on: for ... x y z x y z with n = 3 the proposal is x y z x y ... up to k tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvloom.contracts.config import require, require_int


class NgramProposer:
    """Stateless apart from its settings; the caller passes how many tokens to draft (the
    scheduler's one lookahead number, invariant 6), so the proposer keeps no copy of it."""

    def __init__(self, min_n: int = 1, max_n: int = 4, extend_periodic: bool = True):
        require_int("min_n", min_n, 1)
        require_int("max_n", max_n, min_n)
        require(isinstance(extend_periodic, bool), "extend_periodic", "a bool", extend_periodic)
        self.min_n = min_n
        self.max_n = max_n
        self.extend_periodic = extend_periodic

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` drafted ids for a request whose ids so far (prompt and output)
        are `token_ids`; [] when no n-gram of the allowed sizes recurs."""
        require_int("num_tokens", num_tokens, 0)
        tokens = np.asarray(token_ids, dtype=np.int64)
        require(tokens.ndim == 1, "token_ids", "a flat sequence of ints", type(token_ids))
        length = len(tokens)
        if num_tokens == 0:
            return []
        max_n = min(self.max_n, length - 1)
        ends, match_len = _earlier_suffix_matches(tokens, max_n)
        for n in range(max_n, self.min_n - 1, -1):
            hits = ends[match_len >= n]
            if not hits.size:
                continue
            start = int(hits[-1]) - n + 1  # the latest match of length n
            follow = start + n  # < length: the match ends before the last token
            if not self.extend_periodic:
                return tokens[follow : follow + num_tokens].tolist()
            # Copy forward from `follow`, reading our own output once past the end.
            proposal: list[int] = []
            for i in range(num_tokens):
                source = follow + i
                proposal.append(
                    int(tokens[source]) if source < length else proposal[source - length]
                )
            return proposal
        return []

    def propose_batch(
        self, token_ids: Sequence[Sequence[int]], num_tokens: int | Sequence[int]
    ) -> list[list[int]]:
        counts = [num_tokens] * len(token_ids) if isinstance(num_tokens, int) else num_tokens
        require(len(counts) == len(token_ids), "num_tokens", "an int or one per request", counts)
        return [self.propose(ids, n) for ids, n in zip(token_ids, counts)]


def _earlier_suffix_matches(tokens: np.ndarray, max_n: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions e < len-1 ending an earlier copy of the last token (ascending), and for each
    how many of the sequence's last tokens (up to max_n) end there. One pass over the sequence,
    then work only on the positions that hold the last token."""
    last = len(tokens) - 1
    if max_n < 1:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    ends = np.flatnonzero(tokens[:last] == tokens[last])
    match_len = np.ones(len(ends), dtype=np.int64)
    still = np.ones(len(ends), dtype=bool)
    for m in range(1, max_n):  # m <= max_n - 1 <= last - 1, so tokens[last - m] exists
        before = ends - m
        still &= (before >= 0) & (tokens[np.maximum(before, 0)] == tokens[last - m])
        match_len += still
    return ends, match_len
