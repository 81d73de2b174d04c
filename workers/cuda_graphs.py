"""CUDA graphs for uniform steps: one-token decodes, and (k + 1)-token verifications.

A batch-1 decode step of a large model is a few milliseconds of GPU work spread over
hundreds of small launches; launched one by one from Python they cost more than the work.
`TargetGraphs` captures the model's forward once per batch size of a ladder (1, 2, 4, 8,
then steps of 8 up to the largest size) over static input buffers (`StaticBatch`), for
steps of `query_len` tokens per row, and replays the smallest graph that holds a step:
`query_len` 1 for plain decodes, 1 + k for speculative verification (k drafts a row).

Dispatch uses the one row classification (`RowClasses`, invariant 3), in `graph_key_for`:
- a decode graph only when every row resumes its own state with exactly one token. A
  one-token first chunk (a fresh prompt, no state yet) has the decode *shape* but not the
  decode *meaning*, so such steps run eagerly (`graph_size_for`);
- a verification graph only when every row resumes its state with 1 + k tokens of which
  k are drafts (`verify_graph_size_for`). A chunked prefill whose last chunk is k + 1
  tokens is a resume row of that length too, but it carries no drafts, so it runs
  eagerly; so does a step with a fresh row, or rows with fewer or more than k drafts
  (n-gram lookup finding fewer, async placeholders the worker could not fill). Padding
  such rows with placeholder drafts was not chosen: a hybrid target's linear state is
  backed up only before steps with drafts, and a padded row would advance it over tokens
  no one verifies.

Rows past the real ones are padding: zero-length (`query_start_loc` stays at the real
token count, `seq_lens` 0), no write slot (-1), input token 0 at position 0. Their state
index is -1 in decode graphs (the single-step kernels skip it). A verification graph runs
linear-state layers through their chunked path, which reads and writes every row's state
page, so padding rows point at a scratch state run past the pool's blocks
(`ModelRunner.scratch_state`), zeroed inside the graph before the forward: no request's
page is touched, and nothing stale feeds the padding rows.

A graph runs no Python: forward hooks that EAGLE-3 and DFlash use to read auxiliary
hidden states (`AuxHiddenCapture`) fire only at capture. Their tensors become graph
outputs, and every replay hands them to the capture object as the hooks would have.

`graph_capture.py` turns each forward into a graph (`CudaStepGraph`), or into its CPU
stand-in (`EagerStepGraph`) that the tests use to run this plumbing without CUDA.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvloom.contracts.kv_cache_spec import LinearStateSpec
from kvloom.workers.attention_metadata import (
    SPLIT_DECODE_MAX_ROWS,
    DecodeSplitScratch,
    ForwardBatch,
    GroupMetadata,
)
from kvloom.workers.graph_capture import CudaStepGraph
from kvloom.workers.row_kinds import RowClasses, RowKind


def capture_sizes(max_batch_size: int) -> list[int]:
    """The batch-size ladder: 1, 2, 4, 8, every multiple of 8 up to 256, then every
    multiple of 32 (padding a large batch by up to 31 rows costs little) up to the maximum."""
    ladder = [s for s in (1, 2, 4) if s < max_batch_size]
    ladder += list(range(8, min(max_batch_size, 256) + 1, 8))
    ladder += list(range(288, max_batch_size + 1, 32))
    if not ladder or ladder[-1] != max_batch_size:
        ladder.append(max_batch_size)
    return ladder


def graph_size_for(rows: RowClasses, num_tokens: int, sizes: list[int]) -> int | None:
    """The captured batch size to replay this step with, or None to run it eagerly.

    Only a step whose every row is a true one-token decode (invariant 1) qualifies; a
    stateless one-token first chunk never does, whatever the step's shape.
    """
    num_rows = len(rows.kinds)
    if not sizes or num_rows == 0 or num_tokens != num_rows or num_rows > sizes[-1]:
        return None
    if any(k == RowKind.PADDING for k in rows.kinds) or not rows.uniform_decode(1):
        return None
    return next(s for s in sizes if s >= num_rows)


def verify_graph_size_for(
    rows: RowClasses, num_drafts: list[int], k: int, num_tokens: int, sizes: list[int]
) -> int | None:
    """The captured batch size of the (rows, k) verification graph for this step, or None.

    Every row must resume its own state (invariant 1) with exactly 1 + k tokens, k of them
    drafts: `num_drafts[i]` is the number of drafts row i verifies. A (k + 1)-token final
    prefill chunk resumes with the right length but verifies no drafts; a fresh chunk of
    any length has no state: either keeps the whole step eager.
    """
    num_rows = len(rows.kinds)
    if k < 1 or not sizes or num_rows == 0 or num_rows > sizes[-1]:
        return None
    if len(num_drafts) != num_rows or num_tokens != num_rows * (k + 1):
        return None
    if any(kind == RowKind.PADDING for kind in rows.kinds) or not rows.uniform_decode(k + 1):
        return None
    if any(d != k for d in num_drafts):
        return None
    return next(s for s in sizes if s >= num_rows)


def graph_key_for(
    rows: RowClasses, num_drafts: list[int], num_tokens: int, sizes: list[int], k: int
) -> tuple[int, int] | None:
    """The one dispatch decision of a target step: (captured rows, drafts per row) of the
    graph to replay, (size, 0) for a decode graph and (size, k) for a verification graph,
    or None to run eagerly. k: num_speculative_tokens (0 without speculation)."""
    if not any(num_drafts):
        size = graph_size_for(rows, num_tokens, sizes)
        return None if size is None else (size, 0)
    size = verify_graph_size_for(rows, num_drafts, k, num_tokens, sizes)
    return None if size is None else (size, k)


class StaticBatch:
    """Static copies of a ForwardBatch for up to `max_rows` rows of `query_len` tokens,
    and the views of them a graph of `size` rows is captured over."""

    def __init__(
        self,
        groups,
        layer_to_group: dict[int, int],
        device,
        max_rows: int,
        query_len: int,
        max_model_len: int,
        pad_state: int = -1,
    ):
        self.query_len = query_len
        self.layer_to_group = layer_to_group
        self.device = device
        self.pad_state = pad_state
        self.max_model_len = max_model_len
        # The split-KV decode's partials, made at the first warm-up run and kept by every
        # graph of this batch (decode graphs of at most SPLIT_DECODE_MAX_ROWS rows).
        self.split_scratch = DecodeSplitScratch(min(max_rows, SPLIT_DECODE_MAX_ROWS))
        tokens = max_rows * query_len

        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.positions = zeros(tokens)
        self.query_start_loc = zeros(max_rows + 1, dtype=torch.int32)
        self.seq_lens = zeros(max_rows, dtype=torch.int32)
        self.num_computed = zeros(max_rows, dtype=torch.int32)
        # Wide enough for any request (+1 page for lookahead slots past max_model_len).
        self.block_tables = [
            zeros(max_rows, -(-max_model_len // g.spec.block_size) + 1, dtype=torch.int32)
            for g in groups
        ]
        self.slot_mapping = [zeros(tokens) for _ in groups]
        self.state_indices = [
            zeros(max_rows) if isinstance(g.spec, LinearStateSpec) else None for g in groups
        ]

    def view(self, size: int) -> ForwardBatch:
        """The ForwardBatch a graph of `size` rows reads. Its host-side layout (every row
        a resume row of `query_len` tokens) is what the graph is captured with; replays
        change only the device tensors behind it."""
        q, tokens = self.query_len, size * self.query_len
        groups = [
            GroupMetadata(
                self.block_tables[g][:size],
                self.slot_mapping[g][:tokens],
                None if self.state_indices[g] is None else self.state_indices[g][:size],
            )
            for g in range(len(self.block_tables))
        ]
        return ForwardBatch(
            positions=self.positions[:tokens],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            num_computed_tokens=self.num_computed[:size],
            query_start_loc_list=list(range(0, tokens + 1, q)),
            seq_lens_list=[q] * size,
            rows=RowClasses([RowKind.RESUME] * size, [q] * size),
            groups=groups,
            layer_to_group=self.layer_to_group,
            decode_only=q == 1,
            seq_len_bound=self.max_model_len,
            split_scratch=self.split_scratch,
        )

    def fill_for_capture(self, size: int) -> None:
        """Plausible inputs for capture: each row's tokens at positions 0.. of page 0 (the
        null block), no write slots, so warm-up runs touch no request's pages."""
        q, tokens = self.query_len, size * self.query_len
        self.positions[:tokens] = torch.arange(q, device=self.device).repeat(size)
        self.query_start_loc[: size + 1] = torch.arange(0, tokens + 1, q, device=self.device)
        self.seq_lens[:size] = q
        self.num_computed[:size] = 0
        for g in range(len(self.block_tables)):
            self.block_tables[g][:size] = 0
            self.slot_mapping[g][:tokens] = -1
            if self.state_indices[g] is not None:
                self.state_indices[g][:size] = self.pad_state

    def load(self, batch: ForwardBatch, size: int) -> None:
        """Copies a real step's batch in; rows past its own up to `size` become padding."""
        n, q = batch.num_rows, self.query_len
        real, tokens = batch.positions.shape[0], size * q
        self.positions[:real].copy_(batch.positions)
        self.positions[real:tokens] = 0
        self.query_start_loc[: n + 1].copy_(batch.query_start_loc)
        self.query_start_loc[n + 1 : size + 1] = real
        self.seq_lens[:n].copy_(batch.seq_lens)
        self.seq_lens[n:size] = 0
        self.num_computed[:n].copy_(batch.num_computed_tokens)
        self.num_computed[n:size] = 0
        for g, meta in enumerate(batch.groups):
            table = meta.block_tables
            self.block_tables[g][:n, : table.shape[1]].copy_(table)
            if self.state_indices[g] is not None:  # state pages, no per-token slots
                self.state_indices[g][:n].copy_(meta.state_indices)
                self.state_indices[g][n:size] = self.pad_state
            else:
                self.slot_mapping[g][:real].copy_(meta.slot_mapping)
                self.slot_mapping[g][real:tokens] = -1


class StepGraphs:
    """One graph per captured row count over one StaticBatch and static per-token inputs.

    forward(batch, **inputs) runs the step over views of the static buffers (`inputs`:
    name -> the [tokens, ...] view) and returns a tensor or a tuple of tensors; `replay`
    returns them cut to the step's real tokens. Graphs share one memory pool (`pool`, that
    of graphs captured before, e.g. the target's for a drafter's)."""

    def __init__(
        self,
        forward: Callable,
        inputs: dict[str, torch.Tensor],
        static: StaticBatch,
        sizes: list[int],
    ):
        self.forward = forward
        self.inputs = inputs
        self.static = static
        self.sizes = sizes
        self.graphs: dict[int, object] = {}
        self.pool = None
        self.replays = 0  # steps served by a graph (tests and stats read it)

    @property
    def query_len(self) -> int:
        return self.static.query_len

    def _views(self, size: int) -> dict[str, torch.Tensor]:
        tokens = size * self.static.query_len
        return {name: buf[:tokens] for name, buf in self.inputs.items()}

    @torch.inference_mode()
    def capture(self, make_graph=CudaStepGraph, pool=None) -> None:
        """Largest first, so smaller graphs reuse its memory."""
        self.pool = pool
        for size in reversed(self.sizes):
            self.static.fill_for_capture(size)
            for buf in self.inputs.values():
                buf.zero_()
            batch, views = self.static.view(size), self._views(size)
            graph = make_graph(
                lambda b=batch, v=views: self.forward(b, **v), self.static.device, self.pool
            )
            self.pool = graph.pool
            self.graphs[size] = graph
        if self.static.device.type == "cuda":
            torch.cuda.synchronize(self.static.device)

    def replay(self, size: int, batch: ForwardBatch, **inputs: torch.Tensor):
        """Copies the step's batch and inputs into the static buffers (padding rows past
        the real ones) and replays the graph of `size` rows."""
        real = batch.positions.shape[0]
        for name, value in inputs.items():
            buf = self.inputs[name]
            buf[:real].copy_(value)
            buf[real : size * self.static.query_len] = 0
        self.static.load(batch, size)
        graph = self.graphs[size]
        graph.replay()
        self.replays += 1
        out = graph.outputs
        if isinstance(out, torch.Tensor):
            return out[:real]
        return tuple(t[:real] for t in out)


class TargetGraphs(StepGraphs):
    """The target model's forward, `query_len` tokens a row. `prepare()` runs inside the
    graph first (a verification graph zeroes its scratch state there); `aux`, an
    AuxHiddenCapture, gets the hooked states of every replay (see the module docstring)."""

    def __init__(
        self,
        model,
        groups,
        layer_to_group,
        device,
        sizes: list[int],
        max_model_len: int,
        query_len: int = 1,
        pad_state: int = -1,
        prepare: Callable[[], None] | None = None,
        aux=None,
    ):
        static = StaticBatch(
            groups, layer_to_group, device, sizes[-1], query_len, max_model_len, pad_state
        )
        ids = torch.zeros(sizes[-1] * query_len, dtype=torch.int64, device=device)
        super().__init__(self._run, {"input_ids": ids}, static, sizes)
        self.model = model
        self.prepare = prepare
        self.aux = aux

    def _run(self, batch: ForwardBatch, input_ids: torch.Tensor):
        if self.prepare is not None:
            self.prepare()
        hidden = self.model(input_ids, batch.positions, batch)
        if self.aux is None:
            return hidden
        return (hidden, *self.aux.take())

    def replay(self, size: int, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Returns the real tokens' hidden states (a view of the graph's static output)."""
        out = super().replay(size, batch, input_ids=input_ids)
        if self.aux is None:
            return out
        hidden, *states = out
        self.aux.states = dict(zip(self.aux.points, states))
        return hidden
