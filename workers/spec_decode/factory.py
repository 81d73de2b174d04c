"""Builds the worker-side drafter that `speculative_config.method` names.

Every learned drafter implements the one interface in `drafter.py` (`run(DraftStep)`,
`kv_cache_specs`, `cache_layers`); n-gram lookup has no weights and is built by the runner.
"""

from __future__ import annotations

from kvloom.contracts.config import SpeculativeConfig


def build_drafter(spec: SpeculativeConfig, target, dtype, tp, device, vocab_size: int, progress):
    """The drafter for `spec.method`, or None for n-gram lookup (no model)."""
    if spec.method == "draft_model":
        from kvloom.workers.spec_decode.draft_model import DraftModel

        return DraftModel(spec.model, dtype, tp, device, vocab_size, progress=progress)
    if spec.method == "eagle":
        from kvloom.workers.spec_decode.eagle import EagleProposer

        return EagleProposer(spec.model, target, dtype, tp, device, progress)
    if spec.method == "ngram":
        return None
    raise ValueError(f"speculative_config.method {spec.method!r} has no drafter in this build")
