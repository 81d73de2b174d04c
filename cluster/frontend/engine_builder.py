"""The one place the serving engine is built from `kvloom serve`'s engine arguments.

TP = DCP = 1 runs the model in this process. A larger grid needs the Ray executor; the
Engine picks it from the same arguments once `kvloom.cluster.ray_executor` exists.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from kvloom.cluster.engine import Engine


def build_engine(progress: bool = True, **engine_kwargs: Any) -> Engine:
    tp = engine_kwargs.get("tensor_parallel_size", 1)
    dcp = engine_kwargs.get("decode_context_parallel_size", 1)
    if tp * dcp > 1 and importlib.util.find_spec("kvloom.cluster.ray_executor") is None:
        raise ValueError(
            f"tensor_parallel_size={tp} × decode_context_parallel_size={dcp} needs the Ray "
            "executor, which this build does not have yet; use --tp 1 --dcp 1"
        )
    return Engine(progress=progress, **engine_kwargs)


def engine_factory(progress: bool = True, **engine_kwargs: Any) -> Callable[[], Engine]:
    """A factory for AsyncEngine, which calls it in its own thread."""
    return lambda: build_engine(progress=progress, **engine_kwargs)
