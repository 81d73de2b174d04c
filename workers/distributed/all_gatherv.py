"""All-gather of tensors whose length along one dimension differs by rank (invariant 9).

Each rank contributes a tensor of shape (n_r, *rest) (after moving `dim` to the front); the
result, identical on every rank, is the concatenation in group-rank order, of length
sum(n_r). Ranks may contribute zero rows.

torch's gloo all_gather needs equal shapes, so every piece is padded to the longest one,
gathered, and then each rank's piece is sliced back to its exact length before
concatenation: padding never reaches the result. Pieces travel as raw bytes (a uint8 view),
so every dtype works on every backend (gloo has no int16, for instance) and values arrive
bit for bit, NaN payloads included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

# Dtypes that can be named in the metadata exchange; an index into this tuple is sent.
_DTYPE_CODES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_MAX_DIMS = 8  # shapes are exchanged in a fixed-size record so no rank can hang on a mismatch


def all_gatherv(
    tensor: torch.Tensor,
    group: Any = None,
    sizes: Sequence[int] | None = None,
    dim: int = 0,
) -> torch.Tensor:
    """Concatenate every rank's `tensor` along `dim`, lengths along `dim` may differ.

    group: a `GroupCoordinator`, a torch ProcessGroup, or None for the default world group.
    sizes: every rank's length along `dim`, in group-rank order, when the caller already
        knows them (e.g. DCP shard lengths); otherwise shapes and dtypes are exchanged first,
        and a mismatch in dtype or in any other dimension raises ValueError on every rank.
    """
    process_group, world_size, rank = _resolve_group(group)
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() == 0:
        raise ValueError("tensor must have at least one dimension, got a 0-d tensor")
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(f"dim must be in [{-tensor.dim()}, {tensor.dim()}), got {dim}")
    dim = dim % tensor.dim()

    if sizes is not None:
        sizes = _check_sizes(sizes, world_size, rank, tensor.shape[dim])
    if world_size == 1:
        return tensor

    piece = tensor.movedim(dim, 0).contiguous()
    rest = tuple(piece.shape[1:])
    if sizes is None:
        sizes = _exchange_sizes(piece, process_group, world_size)

    row_numel = 1
    for d in rest:
        row_numel *= d
    row_bytes = row_numel * piece.element_size()
    max_size = max(sizes)
    if max_size == 0 or row_bytes == 0:
        # Nothing to move: every rank already knows the result's shape.
        return piece.new_empty((sum(sizes), *rest)).movedim(0, dim)

    # Rows as raw bytes: (n, row_bytes) uint8. Explicit sizes keep zero-element shapes valid.
    payload = piece.reshape(piece.shape[0], row_numel).view(torch.uint8)
    if piece.shape[0] < max_size:
        padded = payload.new_zeros((max_size, row_bytes))
        padded[: piece.shape[0]] = payload
        payload = padded

    gathered = [torch.empty_like(payload) for _ in range(world_size)]
    dist.all_gather(gathered, payload, group=process_group)
    rows = torch.cat([part[:n] for part, n in zip(gathered, sizes)], dim=0)
    out = rows.view(piece.dtype).reshape(sum(sizes), *rest)
    return out.movedim(0, dim)


def _resolve_group(group: Any) -> tuple[dist.ProcessGroup | None, int, int]:
    # A GroupCoordinator carries its own size and rank, and has no process group at size 1.
    if hasattr(group, "device_group") and hasattr(group, "rank_in_group"):
        return group.device_group, group.world_size, group.rank_in_group
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"group must be a GroupCoordinator, a ProcessGroup or None, got {type(group).__name__}"
        )
    if not dist.is_initialized():
        if group is None:
            return None, 1, 0
        raise ValueError("group is a ProcessGroup but torch.distributed is not initialized")
    return group, dist.get_world_size(group), dist.get_rank(group)


def _check_sizes(sizes: Sequence[int], world_size: int, rank: int, own: int) -> list[int]:
    sizes = list(sizes)
    if len(sizes) != world_size:
        raise ValueError(f"sizes must have one entry per rank ({world_size}), got {len(sizes)}")
    for i, n in enumerate(sizes):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"sizes[{i}] must be an int >= 0, got {n!r}")
    if sizes[rank] != own:
        raise ValueError(
            f"sizes[{rank}] = {sizes[rank]} but this rank's tensor has length {own} on that dim"
        )
    return sizes


def _exchange_sizes(piece: torch.Tensor, group: dist.ProcessGroup | None, world_size: int):
    """Gather every rank's (dtype, ndim, shape); all ranks validate the same records."""
    if piece.dtype in _DTYPE_CODES:
        dtype_code = _DTYPE_CODES.index(piece.dtype)
    else:
        dtype_code = -1  # reported on every rank after the exchange, so none is left waiting
    record = torch.full((2 + _MAX_DIMS,), -1, dtype=torch.int64)
    record[0] = dtype_code
    record[1] = piece.dim()
    shape = list(piece.shape[:_MAX_DIMS])
    record[2 : 2 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
    record = record.to(piece.device)
    records = [torch.empty_like(record) for _ in range(world_size)]
    dist.all_gather(records, record, group=group)
    table = torch.stack(records).cpu().tolist()

    for r, (code, ndim, *_dims) in enumerate(table):
        if code < 0:
            raise ValueError(f"all_gatherv: rank {r} sent a dtype this function does not name")
        if ndim > _MAX_DIMS:
            raise ValueError(f"all_gatherv supports up to {_MAX_DIMS} dims; rank {r} has {ndim}")
    dtypes = {_DTYPE_CODES[row[0]] for row in table}
    if len(dtypes) > 1:
        raise ValueError(f"all_gatherv: ranks disagree on dtype: {[str(d) for d in dtypes]}")
    # Everything but the gathered (leading) dim must agree, ndim included.
    rests = {(row[1], *row[3 : 2 + row[1]]) for row in table}
    if len(rests) > 1:
        shapes = [tuple(row[2 : 2 + row[1]]) for row in table]
        raise ValueError(
            f"all_gatherv: shapes differ outside the gathered dim across ranks: {shapes}"
        )
    return [row[2] for row in table]
