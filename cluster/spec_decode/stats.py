"""Speculative-decoding acceptance statistics, per request and overall.

`record` is called once per verification step of a request, including steps where the
proposer drafted nothing (they still emit one token and count as a step). Reported:
- acceptance_rate: accepted drafts / drafted tokens (None before anything was drafted);
- mean_accepted_per_step: accepted drafts per step;
- mean_tokens_per_step: tokens emitted per step, i.e. accepted + the one bonus/recovered
  token (what vLLM calls the mean acceptance length);
- acceptance_by_position[j]: how often draft j was accepted when it was drafted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvloom.contracts.config import require, require_int


@dataclass
class AcceptanceCounts:
    num_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)

    def add(self, num_drafted: int, num_accepted: int) -> None:
        self.num_steps += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        grow = num_drafted - len(self.drafted_by_position)
        if grow > 0:
            self.drafted_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        for j in range(num_drafted):
            self.drafted_by_position[j] += 1
            # Acceptance is a prefix: draft j is accepted iff more than j were.
            self.accepted_by_position[j] += int(j < num_accepted)

    def summary(self) -> dict:
        steps = self.num_steps
        return {
            "num_steps": steps,
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            "acceptance_rate": self.num_accepted / self.num_drafted if self.num_drafted else None,
            "mean_accepted_per_step": self.num_accepted / steps if steps else None,
            "mean_tokens_per_step": (self.num_accepted + steps) / steps if steps else None,
            "acceptance_by_position": [
                a / d for a, d in zip(self.accepted_by_position, self.drafted_by_position)
            ],
        }


@dataclass
class SpecDecodeStats:
    overall: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    requests: dict[str, AcceptanceCounts] = field(default_factory=dict)

    def record(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        require(isinstance(request_id, str), "request_id", "a str", request_id)
        require_int("num_drafted", num_drafted, 0)
        require_int("num_accepted", num_accepted, 0, num_drafted)
        self.requests.setdefault(request_id, AcceptanceCounts()).add(num_drafted, num_accepted)
        self.overall.add(num_drafted, num_accepted)

    def pop(self, request_id: str) -> AcceptanceCounts | None:
        """Forgets a finished request (the overall counts keep its steps)."""
        return self.requests.pop(request_id, None)

    def summary(self) -> dict:
        return {
            "overall": self.overall.summary(),
            "requests": {rid: counts.summary() for rid, counts in self.requests.items()},
        }


def accepted_per_position(stats: dict) -> list[int]:
    """Accepted drafts by position from an engine's stats; a replica set's are the sums
    of its replicas' (their merged stats keep only scalars)."""
    own = stats.get("spec_accepted_tokens_per_position")
    if own is not None:
        return [int(n) for n in own]
    total: list[int] = []
    for replica in stats.get("replicas") or []:
        for j, n in enumerate(replica.get("spec_accepted_tokens_per_position") or []):
            if j == len(total):
                total.append(0)
            total[j] += int(n)
    return total
