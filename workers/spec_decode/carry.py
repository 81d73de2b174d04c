"""What a speculative step leaves on the worker for the step scheduled behind it.

With async scheduling, step N+1 is scheduled before N's tokens reach the scheduler. For a
request that verified drafts in N the scheduler assumes every draft was accepted, so its
token count runs ahead by the ones that were not, and it gives N+1 placeholder draft
slots. The worker knows how N ended: the tokens N emitted (accepted drafts and the
target's own), how many of the scheduled draft slots were not accepted, and the drafts
it proposed after N. Step N+1's positions, input tokens and drafts come from here.

Kept on the host: verification (the rejection sampler) and every proposer read their
tokens back within the step already, so nothing here adds a wait.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecCarry:
    # Per request that sampled in the step: the position of its first emitted token,
    # the emitted tokens, the scheduled draft slots (placeholders included) that were
    # not accepted, and the drafts proposed for the next step.
    first_position: dict[str, int] = field(default_factory=dict)
    emitted: dict[str, list[int]] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    drafts: dict[str, list[int]] = field(default_factory=dict)

    def unseen(self, request_id: str, num_known: int) -> list[int]:
        """The request's tokens from the previous step that the scheduler had not seen
        when it scheduled this one ([] when it had: the worker was sent them)."""
        position = self.first_position.get(request_id)
        if position is None or position < num_known:
            return []
        if position != num_known:
            raise RuntimeError(
                f"request {request_id}: the previous step emitted from position {position}, "
                f"but the worker knows {num_known} tokens"
            )
        return self.emitted[request_id]

    def forget(self, request_id: str) -> None:
        for table in (self.first_position, self.emitted, self.rejected, self.drafts):
            table.pop(request_id, None)
