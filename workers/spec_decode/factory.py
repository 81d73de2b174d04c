"""Builds the worker-side drafter that `speculative_config.method` names.

Every learned drafter implements the one interface in `drafter.py` (`run(DraftStep)`,
`kv_cache_specs`, `cache_layers`); n-gram lookup has no weights and is built by the runner.
"""

from __future__ import annotations

from kvloom.contracts.config import SpeculativeConfig


def check_drafter(spec: SpeculativeConfig, target_config) -> None:
    """Refuses, before the target loads, a drafter its checkpoint cannot provide."""
    if spec.method == "mtp":
        from kvloom.workers.spec_decode.mtp import check_mtp_checkpoint

        check_mtp_checkpoint(target_config)


def build_drafter(
    spec: SpeculativeConfig,
    target,
    dtype,
    tp,
    device,
    vocab_size: int,
    progress,
    target_config=None,
):
    """The drafter for `spec.method`, or None for n-gram lookup (no model).
    target_config: the target's ModelConfig (mtp reads the target's own checkpoint)."""
    if spec.placement == "remote" and spec.method != "ngram":
        # The drafter runs in its own actor (drafter_server.py); the worker talks to it.
        from kvloom.workers.spec_decode.remote_drafter import RemoteDrafter

        return RemoteDrafter(spec, tp=tp, target=target)
    if spec.method == "draft_model":
        from kvloom.workers.spec_decode.draft_model import DraftModel

        dummy = target_config is not None and target_config.load_format == "dummy"
        seed = target_config.seed if dummy else None
        return DraftModel(
            spec.model, dtype, tp, device, vocab_size, progress=progress, dummy_seed=seed
        )
    if spec.method == "eagle":
        from kvloom.workers.spec_decode.eagle import EagleProposer

        return EagleProposer(spec.model, target, dtype, tp, device, progress)
    if spec.method == "mtp":
        from kvloom.workers.spec_decode.mtp import MtpProposer

        if target_config is None:  # mtp reads the target's own checkpoint
            raise ValueError("speculative_config.method 'mtp' needs the target's model config")
        return MtpProposer(target_config, target, dtype, tp, device, progress)
    if spec.method == "eagle3":
        from kvloom.workers.spec_decode.eagle3 import Eagle3Proposer

        return Eagle3Proposer(spec.model, target, dtype, tp, device, progress)
    if spec.method == "dflash":
        from kvloom.workers.spec_decode.dflash import DFlashProposer

        return DFlashProposer(spec, target, dtype, tp, device, progress)
    if spec.method == "ngram":
        return None
    raise ValueError(f"speculative_config.method {spec.method!r} has no drafter in this build")
