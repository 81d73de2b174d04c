"""kvloom: a serving engine for large language models, hybrid models included."""

from pathlib import Path as _Path

# Run from a source checkout on sys.path (Ray's `--working-dir .`, `python -m` in the
# repo), this folder is found as `kvloom` but its subpackages live beside it: map them the
# way the installed distribution does (pyproject's package-dir).
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "cluster" / "engine.py").is_file() and str(_checkout) not in __path__:
    __path__.append(str(_checkout))


def _import_hub_kernels_first(checkout: _Path) -> None:
    """With the checkout on sys.path (`python -m`, pytest's pythonpath), its folder
    `kernels/` (our kvloom.kernels) would be found as Hugging Face's top-level `kernels`
    package, which transformers >= 5.25 requires and imports from its model modules
    ("cannot import name 'CUDAProperties' from 'kernels'"). Import theirs first, with the
    checkout off the path, so the name is taken by the real package."""
    import importlib
    import importlib.metadata
    import sys

    if "kernels" in sys.modules:
        return
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if _Path(p or ".").resolve() != checkout]
    try:
        importlib.import_module("kernels")
    except Exception:  # a broken optional install must not stop kvloom
        sys.modules.pop("kernels", None)
    finally:
        sys.path[:] = saved


_import_hub_kernels_first(_checkout)

from kvloom.cluster.engine import Engine  # noqa: E402
from kvloom.cluster.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from kvloom.contracts.sampling_params import (  # noqa: E402
    SamplingParams,
    StructuredOutputsParams,
)
from kvloom.llm import LLM  # noqa: E402

__all__ = [
    "LLM",
    "Engine",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "Client",
    "AsyncClient",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The gRPC clients load grpc only when asked for.
    if name in ("Client", "AsyncClient"):
        from kvloom import client

        return getattr(client, name)
    raise AttributeError(f"module 'kvloom' has no attribute {name!r}")
