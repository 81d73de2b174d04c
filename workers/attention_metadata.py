"""Per-step batch description shared by every layer of the forward pass.

`ForwardBatch` is built once per step by the model runner and passed explicitly down
the model (no global context). It holds, per KV-cache group, the block table and slot
mapping, and for the whole batch the row layout and the one row classification
(invariant 1). It also carries the one decision of which paged-attention kernel the step's
attention layers run (`split_decode`), made from that classification.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvloom.kernels.dispatch import batch_invariant
from kvloom.workers.linear_rows import LinearRows, build_linear_rows, build_long_rows
from kvloom.workers.row_kinds import RowClasses

# Uniform-decode steps of at most this many rows take the split-KV decode. On the H200
# (benchmarks/attention_plans.py --split-decode-only, Qwen3-8B heads, in CUDA graphs) it
# ran 1.4x the one-pass kernel at 1 row and 640 keys, 6.1x at 4,096 keys, 1.1-2.0x at 8
# rows; 0.66x at 128 keys (its merge launch); and 0.57-0.85x at 64 and 256 rows, where
# the one-pass grid already fills the GPU. Outside the deterministic mode a decode row's
# bits may differ between steps of <= 8 rows and larger ones, as the GEMV's (1-2 rows).
SPLIT_DECODE_MAX_ROWS = 8


class DecodeSplitScratch:
    """The split-KV decode's float32 partials for up to `max_rows` one-token rows: one
    pair of buffers per (splits, heads, head dim, device), made on first use and then
    reused by every attention layer (they run one after another) and every replay. A
    captured CUDA graph keeps their addresses, so they are never remade; first use is a
    warm-up run before capture (CudaStepGraph), never inside it."""

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self._buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._counters: dict[tuple, torch.Tensor] = {}

    def buffers(self, slots: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Partials [slots, T, Hq, D] and their lse [slots, T, Hq] for q [T, Hq, D]."""
        num_tokens, heads, dim = q.shape
        if num_tokens > self.max_rows:
            raise ValueError(f"split-KV scratch: {num_tokens} rows, made for {self.max_rows}")
        key = (slots, heads, dim, str(q.device))
        if key not in self._buffers:
            shape = (slots, self.max_rows, heads)
            self._buffers[key] = (
                torch.empty((*shape, dim), dtype=torch.float32, device=q.device),
                torch.empty(shape, dtype=torch.float32, device=q.device),
            )
        parts, lses = self._buffers[key]
        return parts[:, :num_tokens], lses[:, :num_tokens]

    def counters(self, num_kv_heads: int, q: torch.Tensor) -> torch.Tensor:
        """The in-launch merge's split counters (`split_merge`): int32 zeros [max_rows,
        Hkv], which every call leaves zero again."""
        key = ("counters", num_kv_heads, str(q.device))
        if key not in self._counters:
            self._counters[key] = torch.zeros(
                (self.max_rows, num_kv_heads), dtype=torch.int32, device=q.device
            )
        return self._counters[key]


@dataclass(frozen=True)
class DecodeSplit:
    """What a uniform-decode step's attention layers need for the split-KV decode kernel
    (kernels/paged_attention_triton.paged_attention_decode_split_triton)."""

    max_seq_len: int  # a host-side bound on seq_lens: sizes the grid (speed only)
    scratch: DecodeSplitScratch | None = None  # None: partials allocated per call (eager)


@dataclass
class GroupMetadata:
    """Where one KV-cache group's tokens live: block table rows and write slots."""

    block_tables: torch.Tensor  # [num_rows, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not write
    # Linear-state groups: the block holding each row's live state (-1 for padding rows).
    state_indices: torch.Tensor | None = None


@dataclass
class ForwardBatch:
    positions: torch.Tensor  # [num_tokens]
    query_start_loc: torch.Tensor  # [num_rows + 1] int32
    seq_lens: torch.Tensor  # [num_rows] context length after this step's tokens
    num_computed_tokens: torch.Tensor  # [num_rows] before this step
    query_start_loc_list: list[int]
    seq_lens_list: list[int]
    rows: RowClasses
    groups: list[GroupMetadata] = field(default_factory=list)
    # layer index -> KV-cache group index, fixed at model construction.
    layer_to_group: dict[int, int] = field(default_factory=dict)
    # Every row is a true decode of one token (invariant 1) and token i belongs to row i;
    # rows past the real ones may be padding (seq_len 0, no write slot, state index -1).
    # Layers then take their host-sync-free decode path (the one CUDA graphs capture).
    decode_only: bool = False
    # A CUDA graph's batch: a host-side bound on seq_lens over every replay (its host
    # layout is made up) and the graph's split-KV scratch. Eager steps leave both None.
    seq_len_bound: int | None = None
    split_scratch: DecodeSplitScratch | None = None
    # Set from the fields above, once: see __post_init__.
    split_decode: DecodeSplit | None = field(init=False, default=None)

    def __post_init__(self):
        # Paged attention of a uniform-decode step (every row a true one-token decode by
        # the one classification: what decode graphs capture) runs the split-KV decode,
        # whose result per row depends on that row only, unless the deterministic mode
        # is on: its mixed steps run decode rows through the one-pass kernel, and it
        # promises the same tokens whatever the step, so its decodes stay there too.
        # Only small steps split: SPLIT_DECODE_MAX_ROWS.
        if self.decode_only and self.num_rows <= SPLIT_DECODE_MAX_ROWS and not batch_invariant():
            bound = self.seq_len_bound
            if bound is None:
                bound = max(self.seq_lens_list, default=1)
            self.split_decode = DecodeSplit(max(bound, 1), self.split_scratch)

    @property
    def num_rows(self) -> int:
        return len(self.seq_lens_list)

    def group_for(self, layer_index: int) -> GroupMetadata:
        return self.groups[self.layer_to_group[layer_index]]

    def linear_rows(self, device) -> LinearRows:
        """The row split of linear-state layers, built on first use and shared by every
        layer of the step."""
        cache = self.__dict__.setdefault("_linear_rows", {})
        key = str(device)
        if key not in cache:
            cache[key] = build_linear_rows(self.rows, self.query_start_loc_list, device)
        return cache[key]

    def long_rows(self, device, min_tokens: int) -> LinearRows:
        """The rows of more than `min_tokens` tokens, as chunked rows (Gated DeltaNet's
        split mixed steps), built on first use and shared by every layer of the step."""
        cache = self.__dict__.setdefault("_long_rows", {})
        key = (str(device), min_tokens)
        if key not in cache:
            cache[key] = build_long_rows(self.rows, self.query_start_loc_list, device, min_tokens)
        return cache[key]
