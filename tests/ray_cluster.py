"""A multi-node Ray cluster on this machine's loopback, for placement tests: a head node
with no CPUs (the driver and the scheduler actor need none) and worker nodes of their own
resources, each a separate raylet, every component on 127.0.0.1 (invariant 12)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def loopback_cluster(node_cpus: list[int]) -> Iterator[object]:
    """Starts the cluster, connects this process to it, yields `ray`; stops everything."""
    import ray
    from ray.cluster_utils import Cluster

    from kvloom.cluster.ray_local import _single_machine_ray

    saved = dict(os.environ)
    # The raylets' workers read this at import: keep their addresses on loopback too.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["AUTOSCALER_METRIC_PORT"] = str(_free_port())
    os.environ["DASHBOARD_METRIC_PORT"] = str(_free_port())
    os.environ.pop("RAY_ADDRESS", None)
    cluster = None
    try:
        with _single_machine_ray():
            cluster = Cluster(
                initialize_head=True,
                head_node_args=dict(
                    num_cpus=0,
                    node_ip_address="127.0.0.1",
                    include_dashboard=False,
                    dashboard_agent_listen_port=_free_port(),
                    ray_client_server_port=_free_port(),
                ),
            )
            for cpus in node_cpus:
                cluster.add_node(
                    num_cpus=cpus,
                    node_ip_address="127.0.0.1",
                    dashboard_agent_listen_port=_free_port(),
                )
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, log_to_driver=False)
        yield ray
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        os.environ.clear()
        os.environ.update(saved)


def node_of(actor) -> str:
    """The Ray node id an actor runs on."""
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))
