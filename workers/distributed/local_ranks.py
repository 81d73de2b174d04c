"""Run a function on every rank of a TP × DCP grid as local processes (tests, benchmarks).

Each rank is a fresh process (torch.multiprocessing spawn) that joins the grid with
`init_parallel_state` and calls `fn(state, *args)`; the return values come back in rank
order. gloo on CPU; with device_type="cuda", rank r uses cuda:r and NCCL.

`fn` must be importable by name (a module-level function), as spawn pickles it by reference.
Return values travel through `torch.save` files, so keep them small.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from kvloom.workers.distributed.process_group import (
    ParallelState,
    RankLayout,
    init_parallel_state,
    pick_init_address,
)


def run_local_ranks(
    fn: Callable[..., Any],
    layout: RankLayout,
    *args: Any,
    device_type: str = "cpu",
    timeout_s: float = 120.0,
) -> list[Any]:
    """`[fn(state_of_rank_0, *args), fn(state_of_rank_1, *args), ...]`, each run in its own
    process. A rank that raises makes this raise (the other ranks are terminated)."""
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    init_address = pick_init_address()
    with tempfile.TemporaryDirectory(prefix="kvloom-ranks-") as out_dir:
        mp.spawn(
            _rank_main,
            args=(fn, layout, init_address, out_dir, args, device_type, timeout_s),
            nprocs=layout.world_size,
            join=True,
        )
        return [
            torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(layout.world_size)
        ]


def _rank_main(
    rank: int,
    fn: Callable[..., Any],
    layout: RankLayout,
    init_address: str,
    out_dir: str,
    args: tuple[Any, ...],
    device_type: str,
    timeout_s: float,
) -> None:
    # Several ranks share few cores; one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")
    state: ParallelState = init_parallel_state(
        layout, rank, init_address, device=device, timeout_s=timeout_s
    )
    try:
        result = fn(state, *args)
    finally:
        state.destroy()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
