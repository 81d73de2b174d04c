"""The one place the serving engine is built from `kvloom serve`'s engine arguments.

executor="inprocess" (one rank) runs the engine in this process. Otherwise (Ray, or a
TP × DCP grid) the scheduler runs in its own Ray actor, which starts the worker actors,
and the front door drives it through `RemoteEngine`; with data_parallel_size > 1, through
a `ReplicaSet` of that many (cluster/replicas.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvloom.cluster.engine import Engine
from kvloom.contracts.gc_freeze import freeze_startup_objects

REPLICA_KWARGS = ("data_parallel_size", "routing", "restart_replicas")


def build_engine(progress: bool = True, **engine_kwargs: Any):
    replicas = {k: engine_kwargs.pop(k) for k in REPLICA_KWARGS if k in engine_kwargs}
    num_replicas = replicas.get("data_parallel_size", 1)
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"data_parallel_size must be an integer >= 1, got {num_replicas!r}")
    tp = engine_kwargs.get("tensor_parallel_size", 1)
    dcp = engine_kwargs.get("decode_context_parallel_size", 1)
    executor = engine_kwargs.get("executor", "auto")
    if executor == "ray" or tp * dcp > 1 or num_replicas > 1:
        if executor == "inprocess":
            raise ValueError(
                f"executor='inprocess' runs one rank of one replica; tensor_parallel_size={tp} "
                f"× decode_context_parallel_size={dcp} × data_parallel_size={num_replicas} "
                "needs executor='ray'"
            )
        from kvloom.cluster.scheduler_actor import RemoteEngine

        kwargs = dict(engine_kwargs, progress=progress)
        if num_replicas == 1:
            return RemoteEngine(kwargs)
        from kvloom.cluster.replicas import ReplicaSet

        return ReplicaSet(
            kwargs,
            num_replicas,
            routing=replicas.get("routing", "prefix"),
            restart=replicas.get("restart_replicas", True),
        )
    engine = Engine(progress=progress, **engine_kwargs)
    freeze_startup_objects()  # a serving process: one engine for its whole life
    return engine


def engine_factory(progress: bool = True, **engine_kwargs: Any) -> Callable[[], Engine]:
    """A factory for AsyncEngine, which calls it in its own thread."""
    return lambda: build_engine(progress=progress, **engine_kwargs)
