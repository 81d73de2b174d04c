"""A launched step whose sampled ids are still on the device.

`ModelRunner.submit` launches a step's GPU work and returns at once; `result()` is where
the host waits for it (one device-to-host copy of the ids). The engine schedules and
launches the next step in between, so the host's bookkeeping overlaps the device's work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvloom.contracts.runner_output import ModelRunnerOutput
from kvloom.workers.sampler import RowSamplingState, finish_sampling


@dataclass
class PendingStep:
    # A step that finished on the host already (drafts, no sampled rows).
    ready: ModelRunnerOutput | None = None
    request_ids: list[str] | None = None
    tokens: torch.Tensor | None = None  # [rows] sampled ids on the device
    raw_logprobs: torch.Tensor | None = None
    rows: list[RowSamplingState] | None = None

    host_tokens: torch.Tensor | None = None  # pinned copy, written in stream order
    copied: object | None = None  # CUDA event recorded after that copy

    def __post_init__(self) -> None:
        # Reading `tokens` later would wait for every launch queued by then, the step
        # scheduled ahead included; a copy queued now and an event wait for this step only.
        if self.tokens is not None and self.tokens.is_cuda:
            self.host_tokens = torch.empty(
                self.tokens.shape, dtype=self.tokens.dtype, pin_memory=True
            )  # straight from the pinned cache (`.pin_memory()` would allocate twice)
            self.host_tokens.copy_(self.tokens, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()

    def result(self) -> ModelRunnerOutput:
        if self.ready is not None:
            return self.ready
        if self.copied is not None:
            self.copied.synchronize()
            ids = self.host_tokens.tolist()
        else:
            ids = self.tokens.tolist()
        infos = finish_sampling(ids, self.raw_logprobs, self.rows)
        out = ModelRunnerOutput({rid: [t] for rid, t in zip(self.request_ids, ids)})
        for rid, info in zip(self.request_ids, infos):
            if info is not None:
                out.logprobs[rid] = [info]
        self.ready = out
        return out
