"""torch.distributed groups for a TP × DCP grid of worker ranks.

Rank layout (world size = tp_size * dcp_size)::

    world rank = dcp_rank * tp_size + tp_rank

TP is the inner, fastest-varying axis, so every TP group is a run of consecutive ranks:
consecutive bundles of a packed placement group, i.e. devices of one node, where the
per-layer all-reduce traffic is heaviest. For tp_size=2, dcp_size=2::

    rank 0 = (tp 0, dcp 0)   rank 1 = (tp 1, dcp 0)
    rank 2 = (tp 0, dcp 1)   rank 3 = (tp 1, dcp 1)
    TP groups  [[0, 1], [2, 3]]      DCP groups [[0, 2], [1, 3]]

World rank 0 is the driver worker: it samples and returns results to the scheduler.

The state is an object (`ParallelState`) passed explicitly to whoever communicates; there is
no module-level global. With world size 1, `single_process_state()` gives groups whose
collectives return their input without touching torch.distributed, so the in-process executor
runs the same code path as the Ray one.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvloom.workers.distributed.all_gatherv import all_gatherv as _all_gatherv

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class RankLayout:
    """Maps world ranks to (tp_rank, dcp_rank) coordinates and back."""

    tp_size: int
    dcp_size: int = 1

    def __post_init__(self) -> None:
        for field in ("tp_size", "dcp_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be an int >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.dcp_size

    def check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")

    def coords(self, rank: int) -> tuple[int, int]:
        """(tp_rank, dcp_rank) of a world rank."""
        self.check_rank(rank)
        return rank % self.tp_size, rank // self.tp_size

    def rank_of(self, tp_rank: int, dcp_rank: int) -> int:
        if not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_size}), got {tp_rank}")
        if not 0 <= dcp_rank < self.dcp_size:
            raise ValueError(f"dcp_rank must be in [0, {self.dcp_size}), got {dcp_rank}")
        return dcp_rank * self.tp_size + tp_rank

    def tp_groups(self) -> list[list[int]]:
        """World ranks of every TP group, ordered by dcp_rank; each group ordered by tp_rank."""
        return [[self.rank_of(t, d) for t in range(self.tp_size)] for d in range(self.dcp_size)]

    def dcp_groups(self) -> list[list[int]]:
        """World ranks of every DCP group, ordered by tp_rank; each group ordered by dcp_rank."""
        return [[self.rank_of(t, d) for d in range(self.dcp_size)] for t in range(self.tp_size)]


def is_loopback_host(host: str) -> bool:
    """Whether `host` (an address Ray reports for this node) is this machine's loopback."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def loopback_init_address() -> str:
    """A rendezvous for ranks that all run on this machine (an embedded local Ray): a
    FileStore file, so rendezvous opens no TCP listener at all. (torch's TCPStore listens
    on every interface whatever host it is given, invariant 12.) torch removes the file
    once every rank has closed it."""
    return f"file://{tempfile.gettempdir()}/kvloom-rendezvous-{uuid.uuid4().hex}"


def pick_init_address(host: str = "127.0.0.1") -> str:
    """A `tcp://host:port` rendezvous address with a port that is free right now.

    The coordinator (the executor, or the rank-0 worker on its own node) calls this and
    hands the same string to every rank. The port is released before torch binds it, so
    another process could take it in between; callers retry setup on an address-in-use error.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port = sock.getsockname()[1]
    return f"tcp://{host}:{port}"


class GroupCoordinator:
    """One communication group as seen from one rank.

    Collectives work on tensors of the group's device (CUDA tensors for NCCL, CPU tensors
    for gloo). A group of size 1 never calls torch.distributed: every collective returns its
    input, so the code that calls them does not branch on world size.
    """

    def __init__(
        self,
        name: str,
        ranks: Sequence[int],
        rank: int,
        process_group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        ranks = tuple(int(r) for r in ranks)
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not in group {name!r} with ranks {ranks}")
        if len(ranks) > 1 and process_group is None:
            raise ValueError(f"process_group is required for group {name!r} of size {len(ranks)}")
        self.name = name
        self.ranks = ranks
        self.rank = rank
        self.rank_in_group = ranks.index(rank)
        self.world_size = len(ranks)
        self.device_group = process_group if len(ranks) > 1 else None
        self.device = device

    @classmethod
    def single(cls, name: str = "world", device: torch.device | str = "cpu") -> GroupCoordinator:
        """A group of one rank (rank 0) that needs no torch.distributed."""
        return cls(name, (0,), 0, None, torch.device(device))

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    def __repr__(self) -> str:
        return (
            f"GroupCoordinator({self.name!r}, ranks={list(self.ranks)}, "
            f"rank_in_group={self.rank_in_group})"
        )

    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        """Reduce in place across the group; returns `tensor`."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=op, group=self.device_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate equal-shaped tensors from every rank along `dim`, in group-rank order.

        For pieces of unequal length use `all_gatherv`.
        """
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        if tensor.is_cuda:
            # One preallocated output: a single NCCL launch that CUDA graphs can capture
            # (graph_collectives.py).
            out = tensor.new_empty((self.world_size * tensor.shape[0], *tensor.shape[1:]))
            dist.all_gather_into_tensor(out, tensor, group=self.device_group)
            return out if dim == 0 else torch.cat(out.chunk(self.world_size), dim=dim)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.device_group)
        return torch.cat(parts, dim=dim)

    def all_gatherv(
        self, tensor: torch.Tensor, sizes: Sequence[int] | None = None, dim: int = 0
    ) -> torch.Tensor:
        """Concatenate tensors whose length along `dim` differs by rank (invariant 9)."""
        return _all_gatherv(tensor, self, sizes=sizes, dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy `tensor` from group rank `src` to every rank, in place; returns `tensor`."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"src must be a group rank in [0, {self.world_size}), got {src}")
        if self.world_size > 1:
            dist.broadcast(tensor, src=self.ranks[src], group=self.device_group)
        return tensor

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        if self.device.type == "cuda":
            # NCCL barriers need to know the device, or they guess from the rank.
            dist.barrier(group=self.device_group, device_ids=[self.device.index])
        else:
            dist.barrier(group=self.device_group)


@dataclass
class ParallelState:
    """The groups one worker rank communicates over; pass it to whatever needs them."""

    layout: RankLayout
    rank: int
    device: torch.device
    world: GroupCoordinator
    tp: GroupCoordinator
    dcp: GroupCoordinator
    owns_process_group: bool = False

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank_in_group

    @property
    def dcp_rank(self) -> int:
        return self.dcp.rank_in_group

    @property
    def is_driver_worker(self) -> bool:
        """World rank 0 samples and answers the scheduler."""
        return self.rank == 0

    def destroy(self) -> None:
        """Tear down torch.distributed if this state created it; safe to call twice."""
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_process_group = False


def single_process_state(device: torch.device | str = "cpu") -> ParallelState:
    """TP = DCP = 1: every collective is a no-op and torch.distributed is not touched."""
    device = torch.device(device)
    return ParallelState(
        layout=RankLayout(1, 1),
        rank=0,
        device=device,
        world=GroupCoordinator.single("world", device),
        tp=GroupCoordinator.single("tp", device),
        dcp=GroupCoordinator.single("dcp", device),
    )


def init_parallel_state(
    layout: RankLayout,
    rank: int,
    init_address: str,
    device: torch.device | str = "cpu",
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> ParallelState:
    """Join the world group at `init_address` and create the TP and DCP sub-groups.

    Every rank calls this with the same `layout` and `init_address` (from
    `pick_init_address`). NCCL is used for CUDA devices, gloo otherwise, unless `backend`
    says. With world size 1 nothing is initialized.
    """
    layout.check_rank(rank)
    device = torch.device(device)
    if layout.world_size == 1:
        return single_process_state(device)
    if not init_address.startswith(("tcp://", "file://")):
        raise ValueError(
            f"init_address must be a tcp://host:port or file:// address, got {init_address!r}"
        )
    if init_address.startswith("file://"):
        # All ranks on this machine: gloo's and NCCL's own sockets stay on loopback too.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        if device.index is None:
            raise ValueError(f"device must name a CUDA index (e.g. cuda:0), got {device}")
        torch.cuda.set_device(device)
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process")

    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend=backend,
        init_method=init_address,
        rank=rank,
        world_size=layout.world_size,
        timeout=timeout,
    )
    world = GroupCoordinator("world", range(layout.world_size), rank, dist.group.WORLD, device)
    tp = _sub_group("tp", layout.tp_groups(), rank, device, timeout)
    dcp = _sub_group("dcp", layout.dcp_groups(), rank, device, timeout)
    return ParallelState(layout, rank, device, world, tp, dcp, owns_process_group=True)


def _sub_group(
    name: str,
    all_groups: list[list[int]],
    rank: int,
    device: torch.device,
    timeout: datetime.timedelta,
) -> GroupCoordinator:
    # new_group is collective over the world: every rank creates every group, in the same
    # order, and keeps the one it belongs to. Groups of size 1 need no process group.
    mine = None
    for ranks in all_groups:
        group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
        if rank in ranks:
            mine = GroupCoordinator(name, ranks, rank, group, device)
    assert mine is not None, f"rank {rank} is in no {name} group"
    return mine
