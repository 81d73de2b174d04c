"""The one classification of batch rows (invariant 1).

A row is *resume* iff its request computed tokens before this step — never because its
query is one token long. A brand-new request whose first chunk is one token is *fresh*
(its state starts from zeros and the slot it was handed is never read); a one-token chunk
that continues a partial prefill is *resume* (it reads its own state). Rows scheduled
zero tokens are *padding*: neither, never counted, their state never touched.

Every metadata builder (linear attention, causal conv, attention, CUDA-graph dispatch)
derives its row kinds from `classify_rows` and nothing else.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property


class RowKind(enum.IntEnum):
    PADDING = 0
    FRESH = 1
    RESUME = 2


def classify_rows(num_computed_tokens: list[int], num_scheduled_tokens: list[int]) -> list[RowKind]:
    kinds = []
    for computed, scheduled in zip(num_computed_tokens, num_scheduled_tokens, strict=True):
        if scheduled == 0:
            kinds.append(RowKind.PADDING)
        elif computed > 0:
            kinds.append(RowKind.RESUME)
        else:
            kinds.append(RowKind.FRESH)
    return kinds


@dataclass
class RowClasses:
    """Views of one classification that kernels consume (computed once: every layer of a
    step asks for them; the classification is not changed after construction)."""

    kinds: list[RowKind]
    num_scheduled_tokens: list[int]

    @cached_property
    def has_initial_state(self) -> list[bool]:
        return [k == RowKind.RESUME for k in self.kinds]

    @cached_property
    def decode_rows(self) -> list[int]:
        """Rows a single-step recurrent kernel may serve: resume rows of one token."""
        return [
            i
            for i, (k, n) in enumerate(zip(self.kinds, self.num_scheduled_tokens))
            if k == RowKind.RESUME and n == 1
        ]

    @cached_property
    def prefill_rows(self) -> list[int]:
        """Rows for the chunked kernel: every fresh row and every multi-token resume row."""
        decode = set(self.decode_rows)
        return [i for i, k in enumerate(self.kinds) if k != RowKind.PADDING and i not in decode]

    @cached_property
    def all_decode(self) -> bool:
        """True iff every non-padding row is a true decode (graph dispatch, invariant 3)."""
        real = [i for i, k in enumerate(self.kinds) if k != RowKind.PADDING]
        return bool(real) and len(self.decode_rows) == len(real)

    def uniform_decode(self, query_len: int) -> bool:
        """True iff every non-padding row resumes its own state with exactly `query_len`
        tokens (1 + drafts): the only steps a uniform-decode CUDA graph may replay
        (invariant 3). A fresh prompt chunk of that length never qualifies."""
        real = [
            (k, n) for k, n in zip(self.kinds, self.num_scheduled_tokens) if k != RowKind.PADDING
        ]
        return bool(real) and all(k == RowKind.RESUME and n == query_len for k, n in real)
