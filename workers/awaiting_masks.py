"""A launched step whose sampling waits for its grammar masks (async scheduling).

The engine schedules a grammar row ahead while its previous token is still in flight; the
row's mask needs that token, so the step goes out with the mask to follow
(`SchedulerOutput.grammar_bitmasks_follow`). `ModelRunner.submit` launches the forward and
the logits and returns this handle; `supply` (the `GrammarBitmasks` for this step) masks
and samples them, on the device, before anything reads the step back.
"""

from __future__ import annotations

from collections.abc import Callable

from kvloom.contracts.runner_output import ModelRunnerOutput
from kvloom.contracts.scheduler_output import GRAMMAR_BITMASKS_VERSION, GrammarBitmasks
from kvloom.workers.pending_step import PendingStep


class AwaitingMasksStep:
    ready: ModelRunnerOutput | None = None  # never finished on the host inside submit

    def __init__(self, step_id: int, sample: Callable[[dict[str, bytes]], PendingStep]):
        self.step_id = step_id
        self._sample = sample
        self._sampled: PendingStep | None = None

    @property
    def supplied(self) -> bool:
        return self._sampled is not None

    def supply(self, masks: GrammarBitmasks) -> None:
        if masks.version != GRAMMAR_BITMASKS_VERSION:
            raise ValueError(
                f"GrammarBitmasks.version {masks.version} is not the version this worker "
                f"reads ({GRAMMAR_BITMASKS_VERSION})"
            )
        if masks.step_id != self.step_id:
            raise RuntimeError(
                f"GrammarBitmasks.step_id {masks.step_id} arrived for step {self.step_id}"
            )
        if self._sampled is not None:
            raise RuntimeError(f"step {self.step_id}: its grammar masks arrived twice")
        self._sampled = self._sample(masks.bitmasks)

    def result(self) -> ModelRunnerOutput:
        if self._sampled is None:
            raise RuntimeError(
                f"step {self.step_id} is read back before its grammar masks arrived "
                "(the engine sends them once the step before it is read)"
            )
        return self._sampled.result()
