"""CUDA graphs for uniform-decode steps (invariant 3).

A batch-1 decode step of a large model is a few milliseconds of GPU work spread over
hundreds of small launches; launched one by one from Python they cost more than the work.
`DecodeGraphs` captures the model's forward once per batch size of a ladder (1, 2, 4, 8,
then steps of 8 up to the largest size) over static input buffers, and replays the
smallest graph that holds a step.

Dispatch uses the one row classification (`RowClasses.uniform_decode`): a graph is
replayed only when every row resumes its own state with exactly one token. A one-token
first chunk (a fresh prompt, no state yet) or a one-token chunk that resumes a prefill
has the decode *shape* but not the decode *meaning* for every layer, so such steps run
eagerly (`graph_size_for`, tested). Rows past the real ones are padding: zero-length
(`query_start_loc` stays at the real token count, `seq_lens` 0), no write slot (-1) and
state index -1, so no kernel reads or writes any state for them.

Graphs are captured only where they are safe: CUDA, one rank (collectives inside graphs
are not supported yet), a model that declares `supports_cuda_graphs`, no drafter.
"""

from __future__ import annotations

import torch

from kvloom.contracts.kv_cache_spec import LinearStateSpec
from kvloom.workers.attention_metadata import ForwardBatch, GroupMetadata
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


class DecodeGraphs:
    """Static buffers sized for the largest batch, and one captured graph per size."""

    def __init__(self, model, groups, layer_to_group, device, sizes: list[int], max_model_len):
        self.model = model
        self.sizes = sizes
        self.device = device
        biggest = sizes[-1]

        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = zeros(biggest)
        self.positions = zeros(biggest)
        self.query_start_loc = zeros(biggest + 1, dtype=torch.int32)
        self.seq_lens = zeros(biggest, dtype=torch.int32)
        self.num_computed = zeros(biggest, dtype=torch.int32)
        # Wide enough for any request (+1 page for lookahead slots past max_model_len).
        self.block_tables = [
            zeros(biggest, -(-max_model_len // g.spec.block_size) + 1, dtype=torch.int32)
            for g in groups
        ]
        self.slot_mapping = [zeros(biggest) for _ in groups]
        self.state_indices = [
            zeros(biggest) if isinstance(g.spec, LinearStateSpec) else None for g in groups
        ]
        self.layer_to_group = layer_to_group
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.replays = 0  # steps served by a graph (tests and stats read it)

    def _batch(self, size: int) -> ForwardBatch:
        """The ForwardBatch the graph of `size` rows reads: views of the static buffers."""
        groups = [
            GroupMetadata(
                self.block_tables[g][:size],
                self.slot_mapping[g][:size],
                None if self.state_indices[g] is None else self.state_indices[g][:size],
            )
            for g in range(len(self.block_tables))
        ]
        return ForwardBatch(
            positions=self.positions[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            num_computed_tokens=self.num_computed[:size],
            query_start_loc_list=list(range(size + 1)),
            seq_lens_list=[1] * size,
            rows=RowClasses([RowKind.RESUME] * size, [1] * size),
            groups=groups,
            layer_to_group=self.layer_to_group,
            decode_only=True,
        )

    def _fill_capture_inputs(self, size: int) -> None:
        """Plausible decode inputs for capture: one token per row at position 0 of page 0
        (the null block), so warm-up runs touch no request's pages."""
        self.input_ids[:size] = 0
        self.positions[:size] = 0
        self.query_start_loc[: size + 1] = torch.arange(size + 1, device=self.device)
        self.seq_lens[:size] = 1
        self.num_computed[:size] = 0
        for g in range(len(self.block_tables)):
            self.block_tables[g][:size] = 0
            self.slot_mapping[g][:size] = -1
            if self.state_indices[g] is not None:
                self.state_indices[g][:size] = -1

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, so smaller graphs reuse its memory pool."""
        for size in reversed(self.sizes):
            self._fill_capture_inputs(size)
            batch = self._batch(size)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up: Triton compiles, cuBLAS plans
                for _ in range(2):
                    self.model(self.input_ids[:size], self.positions[:size], batch)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.model(self.input_ids[:size], self.positions[:size], batch)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
            self.outputs[size] = out
        torch.cuda.synchronize(self.device)

    def replay(self, size: int, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Copies this step's inputs into the static buffers (padding rows past the real
        ones) and replays the graph of `size` rows; returns the real rows' hidden states."""
        n = batch.num_rows
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(batch.positions)
        self.query_start_loc[: n + 1].copy_(batch.query_start_loc)
        self.query_start_loc[n + 1 : size + 1] = n
        self.seq_lens[:n].copy_(batch.seq_lens)
        self.seq_lens[n:size] = 0
        self.num_computed[:n].copy_(batch.num_computed_tokens)
        for g, meta in enumerate(batch.groups):
            table = meta.block_tables
            self.block_tables[g][:n, : table.shape[1]].copy_(table)
            if self.state_indices[g] is not None:  # state pages, no per-token slots
                self.state_indices[g][:n].copy_(meta.state_indices)
                self.state_indices[g][n:size] = -1
            else:
                self.slot_mapping[g][:n].copy_(meta.slot_mapping)
                self.slot_mapping[g][n:size] = -1
        self.graphs[size].replay()
        self.replays += 1
        return self.outputs[size][:n]
