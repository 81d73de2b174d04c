"""The one place the serving engine is built from `kvloom serve`'s engine arguments.

executor="inprocess" (one rank) runs the engine in this process. Otherwise (Ray, or a
TP × DCP grid) the scheduler runs in its own Ray actor, which starts the worker actors,
and the front door drives it through `RemoteEngine`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvloom.cluster.engine import Engine
from kvloom.contracts.gc_freeze import freeze_startup_objects


def build_engine(progress: bool = True, **engine_kwargs: Any):
    tp = engine_kwargs.get("tensor_parallel_size", 1)
    dcp = engine_kwargs.get("decode_context_parallel_size", 1)
    executor = engine_kwargs.get("executor", "auto")
    if executor == "ray" or tp * dcp > 1:
        if executor == "inprocess":
            raise ValueError(
                f"executor='inprocess' runs one rank; tensor_parallel_size={tp} × "
                f"decode_context_parallel_size={dcp} needs executor='ray'"
            )
        from kvloom.cluster.scheduler_actor import RemoteEngine

        return RemoteEngine(dict(engine_kwargs, progress=progress))
    engine = Engine(progress=progress, **engine_kwargs)
    freeze_startup_objects()  # a serving process: one engine for its whole life
    return engine


def engine_factory(progress: bool = True, **engine_kwargs: Any) -> Callable[[], Engine]:
    """A factory for AsyncEngine, which calls it in its own thread."""
    return lambda: build_engine(progress=progress, **engine_kwargs)
