"""kvloom: a serving engine for large language models, hybrid models included."""

from pathlib import Path as _Path

# Run from a source checkout on sys.path (Ray's `--working-dir .`, `python -m` in the
# repo), this folder is found as `kvloom` but its subpackages live beside it: map them the
# way the installed distribution does (pyproject's package-dir).
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "cluster" / "engine.py").is_file() and str(_checkout) not in __path__:
    __path__.append(str(_checkout))

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
