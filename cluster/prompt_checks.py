"""Checks of a prompt's token ids that the engine and the front door's proxy both make,
so a bad request is refused where it enters, with the same message."""

from __future__ import annotations


def check_prompt_token_ids(token_ids: object, vocab_size: int, max_model_len: int) -> list[int]:
    """Returns the ids as a list; raises ValueError naming the problem."""
    if not isinstance(token_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in token_ids
    ):
        raise ValueError("prompt_token_ids must be a list of integers")
    if not token_ids:
        raise ValueError("prompt must not be empty (it has no tokens)")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
        )
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"prompt is {len(token_ids)} tokens, at or over max_model_len ({max_model_len}); "
            "it must leave room for at least one generated token"
        )
    return token_ids
