"""`LLM(deterministic=...)`, ARCHITECTURE §7's name for the batch-invariant mode."""

from __future__ import annotations

import pytest

from kvloom import LLM

SETTINGS = dict(dtype="float32", block_size=4, max_num_seqs=4, progress=False)


def test_deterministic_mode_is_refused_until_it_exists(tiny_model):
    """`deterministic=False` (ARCHITECTURE §7) is accepted; True is refused by name rather
    than silently not honoured."""
    path = str(tiny_model("qwen2"))
    LLM(path, deterministic=False, **SETTINGS).shutdown()
    with pytest.raises(ValueError, match="deterministic must be False"):
        LLM(path, deterministic=True, **SETTINGS)
