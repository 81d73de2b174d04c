"""TP × DCP rank layout and its torch.distributed groups: a 2×2 grid over gloo with
collectives in each sub-group, a TP-only grid whose DCP groups have one rank, and the
world-size-1 state that never touches torch.distributed."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from kvloom.workers.distributed.local_ranks import run_local_ranks
from kvloom.workers.distributed.process_group import (
    GroupCoordinator,
    ParallelState,
    RankLayout,
    init_parallel_state,
    pick_init_address,
    single_process_state,
)


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 1), (1, 4), (2, 2), (4, 2), (2, 3)])
def test_layout_groups_partition_the_grid(tp, dcp):
    layout = RankLayout(tp, dcp)
    assert layout.world_size == tp * dcp
    tp_groups, dcp_groups = layout.tp_groups(), layout.dcp_groups()
    assert sorted(r for g in tp_groups for r in g) == list(range(tp * dcp))
    assert sorted(r for g in dcp_groups for r in g) == list(range(tp * dcp))
    for rank in range(layout.world_size):
        t, d = layout.coords(rank)
        assert layout.rank_of(t, d) == rank
        assert rank == d * tp + t  # the documented layout: TP is the inner axis
        assert tp_groups[d][t] == rank
        assert dcp_groups[t][d] == rank
    for group in tp_groups:  # consecutive ranks: one node's devices in a packed placement
        assert group == list(range(group[0], group[0] + tp))


def test_layout_2x2_is_as_documented():
    layout = RankLayout(tp_size=2, dcp_size=2)
    assert layout.tp_groups() == [[0, 1], [2, 3]]
    assert layout.dcp_groups() == [[0, 2], [1, 3]]
    assert [layout.coords(r) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_layout_rejects_bad_values():
    with pytest.raises(ValueError, match="tp_size"):
        RankLayout(0, 1)
    with pytest.raises(ValueError, match="dcp_size"):
        RankLayout(2, 1.5)
    with pytest.raises(ValueError, match="rank"):
        RankLayout(2, 2).coords(4)
    with pytest.raises(ValueError, match="tp_rank"):
        RankLayout(2, 2).rank_of(2, 0)
    with pytest.raises(ValueError, match="dcp_rank"):
        RankLayout(2, 2).rank_of(0, -1)


def test_pick_init_address_gives_a_bindable_port():
    address = pick_init_address()
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    assert address.startswith("tcp://") and host == "127.0.0.1"
    with socket.socket() as sock:
        sock.bind((host, int(port)))


def test_single_process_state_is_a_no_op_without_torch_distributed():
    state = init_parallel_state(RankLayout(1, 1), 0, "tcp://127.0.0.1:1")
    assert not dist.is_initialized()
    assert (state.rank, state.world_size, state.tp_rank, state.dcp_rank) == (0, 1, 0, 0)
    assert state.is_driver_worker
    t = torch.arange(4.0)
    for group in (state.world, state.tp, state.dcp):
        assert group.world_size == 1 and group.device_group is None
        assert group.all_reduce(t) is t
        assert group.all_gather(t) is t
        assert group.all_gatherv(t) is t
        assert group.broadcast(t) is t
        group.barrier()
    assert torch.equal(t, torch.arange(4.0))
    state.destroy()
    assert single_process_state().layout == RankLayout(1, 1)


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="rank"):
        init_parallel_state(RankLayout(2), 2, "tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="init_address"):
        init_parallel_state(RankLayout(2), 0, "env://")
    with pytest.raises(ValueError, match="src"):
        GroupCoordinator.single().broadcast(torch.zeros(1), src=1)
    with pytest.raises(ValueError, match="process_group"):
        GroupCoordinator("tp", [0, 1], 0, None, torch.device("cpu"))
    with pytest.raises(ValueError, match="not in group"):
        GroupCoordinator("tp", [0, 1], 2, None, torch.device("cpu"))


def _grid_collectives(state: ParallelState) -> dict:
    """Run every collective in every group; return what this rank saw."""
    rank, dev = state.rank, state.device
    out = {
        "coords": (state.tp_rank, state.dcp_rank),
        "tp_ranks": state.tp.ranks,
        "dcp_ranks": state.dcp.ranks,
        "dcp_is_process_group": state.dcp.device_group is not None,
    }
    for name, group in (("world", state.world), ("tp", state.tp), ("dcp", state.dcp)):
        values = torch.tensor([rank + 1.0, 10.0 * (rank + 1)], device=dev)
        out[f"{name}_sum"] = group.all_reduce(values)
        out[f"{name}_max"] = group.all_reduce(torch.tensor([rank], device=dev), dist.ReduceOp.MAX)
        out[f"{name}_gather"] = group.all_gather(torch.full((1, 2), rank, device=dev), dim=0)
        # Uneven pieces inside a sub-group: sizes are indexed by rank within the group.
        out[f"{name}_gatherv"] = group.all_gatherv(torch.full((rank % 3,), rank, device=dev))
        src = group.world_size - 1  # the last member, so group-rank vs world-rank mix-ups show
        out[f"{name}_bcast"] = group.broadcast(torch.tensor([rank * 7], device=dev), src=src)
        group.barrier()
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def _check_grid(layout: RankLayout, results: list[dict]) -> None:
    tp_of = {r: g for g in layout.tp_groups() for r in g}
    dcp_of = {r: g for g in layout.dcp_groups() for r in g}
    world = list(range(layout.world_size))
    for rank, res in enumerate(results):
        assert res["coords"] == layout.coords(rank)
        assert list(res["tp_ranks"]) == tp_of[rank]
        assert list(res["dcp_ranks"]) == dcp_of[rank]
        assert res["dcp_is_process_group"] == (layout.dcp_size > 1)
        for name, members in (("world", world), ("tp", tp_of[rank]), ("dcp", dcp_of[rank])):
            want_sum = torch.tensor(
                [sum(m + 1.0 for m in members), sum(10.0 * (m + 1) for m in members)]
            )
            assert torch.equal(res[f"{name}_sum"], want_sum), (rank, name)
            assert res[f"{name}_max"].item() == max(members), (rank, name)
            want_gather = torch.cat([torch.full((1, 2), m) for m in members])
            assert torch.equal(res[f"{name}_gather"], want_gather), (rank, name)
            want_gatherv = torch.cat([torch.full((m % 3,), m) for m in members])
            assert torch.equal(res[f"{name}_gatherv"], want_gatherv), (rank, name)
            assert res[f"{name}_bcast"].item() == members[-1] * 7, (rank, name)


@pytest.mark.timeout(120)
def test_tp2_dcp2_grid_collectives_in_each_subgroup():
    layout = RankLayout(tp_size=2, dcp_size=2)
    _check_grid(layout, run_local_ranks(_grid_collectives, layout, timeout_s=60))


@pytest.mark.timeout(120)
def test_tp2_grid_has_single_rank_dcp_groups():
    layout = RankLayout(tp_size=2, dcp_size=1)
    _check_grid(layout, run_local_ranks(_grid_collectives, layout, timeout_s=60))


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_tp2_grid_over_nccl_on_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, found {torch.cuda.device_count()}")
    layout = RankLayout(tp_size=2, dcp_size=1)
    results = run_local_ranks(_grid_collectives, layout, device_type="cuda", timeout_s=120)
    _check_grid(layout, results)
