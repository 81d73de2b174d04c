"""CUDA graphs of a drafter's proposal steps (draft model, EAGLE, EAGLE-3, MTP heads).

After catching up, these drafters propose k tokens one position at a time: k forwards of
one token per sampled row, a fixed row count within the step. Each such forward is a
uniform one-token decode of the drafter's own layers, so it replays a graph captured per
row count of the target's ladder, chosen by the same dispatch (`graph_size_for` over the
batch's one row classification). The graph holds the whole proposal step: embedding, the
drafter's layers, LM head and argmax; what it returns (the draft ids, and for EAGLE-style
heads the state fed to the next position) are static buffers, read or copied into the
next replay's inputs before anything overwrites them.

The catch-up forward (the kept tokens of every row, any shape) stays eager.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvloom.workers.attention_metadata import ForwardBatch
from kvloom.workers.cuda_graphs import StaticBatch, StepGraphs, graph_size_for


class ProposalGraphs:
    """step(batch, **inputs) -> tensor or tuple: one proposal position, captured per row
    count of `sizes`; `inputs`: name -> (row width or None for a scalar per row, dtype)."""

    def __init__(
        self,
        step: Callable,
        inputs: dict[str, tuple[int | None, torch.dtype]],
        groups,
        layer_to_group: dict[int, int],
        device,
        sizes: list[int],
        max_model_len: int,
    ):
        rows = sizes[-1]
        buffers = {
            name: torch.zeros(
                (rows,) if width is None else (rows, width), dtype=dtype, device=device
            )
            for name, (width, dtype) in inputs.items()
        }
        static = StaticBatch(groups, layer_to_group, device, rows, 1, max_model_len)
        self.graphs = StepGraphs(step, buffers, static, sizes)

    @property
    def replays(self) -> int:
        return self.graphs.replays

    @property
    def pool(self):
        return self.graphs.pool

    def capture(self, make_graph, pool=None) -> None:
        self.graphs.capture(make_graph, pool)

    def run(self, batch: ForwardBatch, **inputs: torch.Tensor):
        """The step's outputs from a graph, or None where none fits (run it eagerly)."""
        size = graph_size_for(batch.rows, batch.positions.shape[0], self.graphs.sizes)
        if size is None:
            return None
        for name, value in inputs.items():
            if value.shape[1:] != self.graphs.inputs[name].shape[1:]:
                return None  # not the shape captured (a head state of another width)
        return self.graphs.replay(size, batch, **inputs)
