"""Where a replica's TP × DCP worker grid runs: Ray placement groups, checked up front.

A tensor-parallel group all-reduces in every layer, so its ranks stay on one node (one
STRICT_PACK placement group per TP group). DCP ranks exchange far less (one all-gather of
attention partials per layer), so the TP groups of one replica may sit on different nodes.
A grid that fits one node is packed on one node all the same (one placement group).

Before asking Ray, the grid is checked against the nodes' total resources: a grid that no
arrangement of the cluster's nodes can hold fails at once, naming what each node has. A
grid that fits on paper but not now (another replica holds the devices) waits up to
`KVLOOM_PLACEMENT_TIMEOUT_S` for them, then fails with what is free.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from kvloom.contracts.envs import placement_timeout_s


class PlacementError(ValueError):
    """The grid cannot be placed on this Ray cluster; the message names the resources."""


def _node_capacity(resources: dict[str, float], bundle: dict[str, float]) -> int:
    """How many bundles a node with these total resources holds."""
    return int(min(resources.get(key, 0.0) // need for key, need in bundle.items() if need > 0))


def _describe_nodes(nodes: list[dict[str, Any]]) -> str:
    parts = []
    for node in nodes:
        have = node["Resources"]
        shown = ", ".join(f"{k} {have[k]:g}" for k in ("CPU", "GPU") if k in have) or "nothing"
        parts.append(f"node {node['NodeManagerAddress']} ({node['NodeID'][:8]}): {shown}")
    return "; ".join(parts) or "no live nodes"


def plan_groups(
    tp: int, dcp: int, bundle: dict[str, float], nodes: list[dict[str, Any]]
) -> list[int]:
    """The sizes of the placement groups to ask for: [tp * dcp] when some node holds the
    whole grid, else [tp] * dcp (each TP group on one node). Raises PlacementError when the
    nodes' totals cannot hold the grid either way."""
    capacities = [_node_capacity(n["Resources"], bundle) for n in nodes]
    world = tp * dcp
    if any(c >= world for c in capacities):
        return [world]
    if sum(c // tp for c in capacities) >= dcp:
        return [tp] * dcp
    raise PlacementError(
        f"tensor_parallel_size={tp} × decode_context_parallel_size={dcp} needs {dcp} group(s) "
        f"of {tp} bundles of {bundle}, each group on one node; the Ray cluster cannot hold "
        f"that ({_describe_nodes(nodes)})"
    )


@dataclass
class GridPlacement:
    """The placement groups of one grid; `strategy(rank)` places a worker rank. Ranks of a
    TP group are consecutive (rank = dcp_rank * tp + tp_rank), so group g holds ranks
    [g * size, (g + 1) * size)."""

    groups: list[Any]
    group_size: int
    bundle: dict[str, float] = field(default_factory=dict)

    def strategy(self, rank: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group, index = divmod(rank, self.group_size)
        return PlacementGroupSchedulingStrategy(
            self.groups[group], placement_group_bundle_index=index
        )

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in self.groups:
            # Already removed where an actor's own shutdown got there first.
            with contextlib.suppress(Exception):
                remove_placement_group(group)


def place_grid(tp: int, dcp: int, bundle: dict[str, float]) -> GridPlacement:
    """Reserves the grid's bundles, or raises PlacementError within the placement timeout."""
    import ray
    from ray.util.placement_group import placement_group

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    sizes = plan_groups(tp, dcp, bundle, nodes)
    groups = [placement_group([bundle] * size, strategy="STRICT_PACK") for size in sizes]
    placement = GridPlacement(groups, sizes[0], bundle)
    timeout = placement_timeout_s()
    try:
        ray.get([g.ready() for g in groups], timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        placement.remove()
        raise PlacementError(
            f"tensor_parallel_size={tp} × decode_context_parallel_size={dcp}: no room for "
            f"{len(sizes)} group(s) of {sizes[0]} bundles of {bundle} within {timeout:g} s "
            f"(KVLOOM_PLACEMENT_TIMEOUT_S); free now: {ray.available_resources()}"
        ) from None
    return placement
