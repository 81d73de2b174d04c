"""A replica's grid over several Ray nodes (cluster/placement.py): each TP group on one
node, DCP ranks across nodes, tokens equal to one rank's (float64); a grid the cluster
cannot hold fails start at once with the resources named."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvloom import Engine
from kvloom.cluster.placement import PlacementError
from tests.engine_helpers import PROMPTS, assert_pool_full, greedy, run_to_completion
from tests.ray_cluster import loopback_cluster, node_of

pytestmark = pytest.mark.slow


def engine(path, **kw) -> Engine:
    return Engine(
        model=str(path), dtype="float64", progress=False, block_size=4, executor="ray", **kw
    )


@pytest.fixture(scope="module")
def two_nodes():
    """Two worker nodes of 2 CPUs each: a TP=2 × DCP=2 grid cannot fit on one."""
    with loopback_cluster([2, 2]) as ray:
        yield ray


@pytest.mark.parametrize("family", ["dense", "qwen3_next"])
def test_tp2_dcp2_over_two_nodes_matches_one_rank(two_nodes, tiny_model, hybrid_model, family):
    path = tiny_model("qwen2") if family == "dense" else hybrid_model("qwen3_next")
    single = Engine(model=str(path), dtype="float64", progress=False, block_size=4)
    expected = [o.outputs[0].token_ids for o in run_to_completion(single, PROMPTS, greedy(8))]
    eng = engine(path, tensor_parallel_size=2, decode_context_parallel_size=2)
    try:
        nodes = [node_of(actor) for actor in eng.executor.actors]
        # rank = dcp_rank * tp + tp_rank: ranks 0-1 are one TP group, 2-3 the other.
        assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
        outs = run_to_completion(eng, PROMPTS, greedy(8))
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert_pool_full(eng)
    finally:
        eng.shutdown()
    assert_cpus_free(two_nodes, 4)  # the bundles were returned


def assert_cpus_free(ray, cpus: float, within_s: float = 10) -> None:
    deadline = time.monotonic() + within_s
    while ray.available_resources().get("CPU", 0) != cpus and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == cpus


def test_a_grid_no_node_arrangement_holds_fails_at_once(two_nodes, tiny_model):
    start = time.monotonic()
    with pytest.raises(PlacementError, match=r"tensor_parallel_size=4 .* CPU 2") as err:
        engine(tiny_model("qwen2"), tensor_parallel_size=4)
    assert time.monotonic() - start < 30
    assert "each group on one node" in str(err.value)


def test_a_grid_whose_devices_are_taken_fails_within_the_timeout(
    two_nodes, tiny_model, monkeypatch
):
    from ray.util.placement_group import placement_group, remove_placement_group

    held = placement_group([{"CPU": 2}], strategy="STRICT_PACK")  # one node's CPUs
    two_nodes.get(held.ready(), timeout=60)
    monkeypatch.setenv("KVLOOM_PLACEMENT_TIMEOUT_S", "3")
    try:
        start = time.monotonic()
        with pytest.raises(PlacementError, match=r"within 3 s .* free now"):
            engine(tiny_model("qwen2"), tensor_parallel_size=2, decode_context_parallel_size=2)
        assert time.monotonic() - start < 30
    finally:
        remove_placement_group(held)


def test_embedded_ray_starts_its_own_beside_another_ray(two_nodes):
    """With RAY_ADDRESS unset, kvloom starts a Ray of its own even where another Ray runs
    on this host: ray.init() alone would join that one and refuse num_cpus (seen when two
    test runs shared a machine)."""
    code = (
        "import ray; from kvloom.cluster.ray_local import connect_ray, shutdown_ray; "
        "connect_ray(1); print('GCS', ray.get_runtime_context().gcs_address); shutdown_ray()"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    gcs = next(line.split()[1] for line in run.stdout.splitlines() if line.startswith("GCS "))
    assert gcs.startswith("127.0.0.1:")
    assert gcs != two_nodes.get_runtime_context().gcs_address
