"""kvloom: a serving engine for large language models, hybrid models included."""

from kvloom.cluster.engine import Engine
from kvloom.cluster.outputs import CompletionOutput, Logprob, RequestOutput
from kvloom.cluster.sampling_params import SamplingParams
from kvloom.llm import LLM

__all__ = ["LLM", "Engine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
