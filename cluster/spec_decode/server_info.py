"""GetServerInfo's speculative-decoding figures, from the engine's config and stats."""

from __future__ import annotations

from typing import Any

from kvloom.cluster.spec_decode.stats import accepted_per_position
from kvloom.contracts.config import SpeculativeConfig


def spec_decode_fields(spec: SpeculativeConfig, stats: dict[str, Any]) -> dict[str, Any] | None:
    """The fields of a SpecDecodeInfo message, or None when speculation is off."""
    if not spec.enabled:
        return None
    drafts = int(stats.get("spec_num_drafts", 0))
    drafted = int(stats.get("spec_drafted_tokens", 0))
    accepted = int(stats.get("spec_accepted_tokens", 0))
    return {
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "placement": spec.placement,
        "num_drafts": drafts,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
        "accepted_tokens_per_position": accepted_per_position(stats),
        "drafter_available": drafter_available(stats),
    }


def drafter_available(stats: dict[str, Any]) -> bool:
    """Whether every replica's remote drafter answers (True without remote drafters)."""
    if "spec_drafter_available" in stats:
        return bool(stats["spec_drafter_available"])
    return all(bool(r.get("spec_drafter_available", True)) for r in stats.get("replicas") or [])
