"""What the workers send back each step: the driver rank's sampled tokens, the drafts it
proposed for the next step and the logprobs asked for. Plain data, cheap to serialize
(the result channel encodes it with msgspec)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelRunnerOutput:
    """request id -> sampled token ids (empty for a partial prefill chunk)."""

    sampled_token_ids: dict[str, list[int]]
    # request id -> drafts proposed on the worker for the next step (every proposer)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request id -> drafts verified this step, where fewer than scheduled (placeholder
    # slots the worker had no proposal for); the rest count as rejected.
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    # request id -> per sampled token: (sampled logprob, sampled rank, [(id, logprob), ...])
    logprobs: dict[str, list[tuple[float, int, list[tuple[int, float]]]]] = field(
        default_factory=dict
    )
