"""Which tokens of a mixed step go to the chunked and which to the single-step kernels of a
linear-state layer (Gated DeltaNet, KDA), built once per step.

Every linear-state layer of a model serves the same rows the same way (the one
classification, invariant 1), so the index tensors are made once per step and device and
shared: before, each layer rebuilt them from Python lists, which cost O(tokens) host time
per layer on long prefill steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvloom.kernels.device_copy import to_device, to_device_packed
from kvloom.workers.row_kinds import RowClasses


@dataclass(frozen=True)
class LinearRows:
    """prefill_*: every fresh row and every multi-token resume row (chunked kernels);
    decode_*: resume rows of one token (single-step kernels, in place on the pool)."""

    prefill_rows: list[int]
    prefill_rows_index: torch.Tensor  # [P] int64 on the device: rows, for state_indices
    prefill_tokens: torch.Tensor  # [sum of their lengths] int64 on the device
    cu_seqlens: torch.Tensor  # [P + 1] int64 on the host: chunk boundaries
    # The same bounds on the device, copied once per step: the chunked kernels take this one
    # object in every layer, so none copies (and waits) per layer, and fla's identity cache
    # of its chunk layout hits after the first layer.
    cu_seqlens_device: torch.Tensor
    has_initial_state: torch.Tensor  # [P] bool on the device
    decode_rows: list[int]
    decode_rows_index: torch.Tensor  # [D] int64 on the device
    decode_tokens: torch.Tensor  # [D] int64 on the device: each row's one token


def build_linear_rows(rows: RowClasses, query_start_loc: list[int], device) -> LinearRows:
    return _linear_rows(rows, query_start_loc, device, rows.prefill_rows, rows.decode_rows)


def build_long_rows(
    rows: RowClasses, query_start_loc: list[int], device, min_tokens: int
) -> LinearRows:
    """Only the rows of more than `min_tokens` tokens, all as chunked rows (no decode
    rows): Gated DeltaNet's split mixed steps serve the others token by token."""
    lens = rows.num_scheduled_tokens
    long_rows = [i for i, n in enumerate(lens) if n > min_tokens]
    return _linear_rows(rows, query_start_loc, device, long_rows, [])


def _linear_rows(rows: RowClasses, query_start_loc: list[int], device, prefill, decode):
    starts = torch.tensor(query_start_loc, dtype=torch.int64)
    prefill_host = torch.tensor(prefill, dtype=torch.int64)
    lens = starts[prefill_host + 1] - starts[prefill_host]
    cu = torch.zeros(len(prefill) + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=cu[1:])
    # Token t of prefill row r sits at starts[r] + (t - cu[r]).
    offsets = torch.repeat_interleave(starts[prefill_host] - cu[:-1], lens)
    tokens = torch.arange(int(cu[-1]), dtype=torch.int64) + offsets
    flags = rows.has_initial_state
    has_state = torch.tensor([flags[i] for i in prefill], dtype=torch.bool)
    decode_host = torch.tensor(decode, dtype=torch.int64)
    # Staged copies (kernels/device_copy.py): a plain `.to(device)` from pageable memory
    # waits for every launch queued before it, which in a mixed step is the step so far.
    host = [prefill_host, tokens, cu, decode_host, starts[decode_host]]
    rows_index, tokens_dev, cu_dev, decode_index, decode_tokens = to_device_packed(
        [np.asarray(t.numpy()) for t in host], torch.int64, torch.device(device)
    )
    return LinearRows(
        prefill_rows=prefill,
        prefill_rows_index=rows_index,
        prefill_tokens=tokens_dev,
        cu_seqlens=cu,
        cu_seqlens_device=cu_dev,
        has_initial_state=to_device(has_state, torch.bool, torch.device(device)),
        decode_rows=decode,
        decode_rows_index=decode_index,
        decode_tokens=decode_tokens,
    )
