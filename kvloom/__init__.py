"""kvloom: a serving engine for large language models, hybrid models included."""

from kvloom.cluster.engine import Engine
from kvloom.cluster.outputs import CompletionOutput, Logprob, RequestOutput
from kvloom.cluster.sampling_params import SamplingParams
from kvloom.llm import LLM

__all__ = [
    "LLM",
    "Engine",
    "SamplingParams",
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
