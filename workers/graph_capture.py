"""How one step's forward becomes a replayable graph.

`CudaStepGraph` captures the forward with `torch.cuda.CUDAGraph`. `EagerStepGraph` is its
CPU stand-in: it runs the same forward over the same static input buffers at every
replay and copies the results into outputs made once, at "capture". A caller therefore
sees exactly what a real graph gives it: outputs that are static buffers, overwritten by
the next replay (a drafter that keeps a view of them across steps reads garbage in both),
and inputs read only from the static buffers. Tests pass `EagerStepGraph` where the
runner would pass `CudaStepGraph`, so the replay plumbing runs on CPU.

`forward()` takes no arguments (it closes over the static buffers) and returns a tensor
or a tuple of tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Outputs = torch.Tensor | tuple[torch.Tensor, ...]


def _flat(outputs: Outputs) -> tuple[torch.Tensor, ...]:
    return (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)


class CudaStepGraph:
    """A CUDA graph of `forward`, after two warm-up runs on a side stream (Triton
    compiles, cuBLAS plans, NCCL communicators first used) so capture records only
    kernel launches. `pool`: a memory pool shared with graphs captured before."""

    def __init__(self, forward: Callable[[], Outputs], device, pool=None):
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = forward()
        self.pool = self.graph.pool() if pool is None else pool

    def replay(self) -> None:
        self.graph.replay()


class EagerStepGraph:
    """The CPU stand-in: replay reruns `forward` eagerly and copies its results into the
    outputs made at construction (static, like a captured graph's)."""

    def __init__(self, forward: Callable[[], Outputs], device=None, pool=None):
        self.forward = forward
        self.outputs = forward()
        self.pool = pool

    def replay(self) -> None:
        fresh = _flat(self.forward())
        for static, value in zip(_flat(self.outputs), fresh, strict=True):
            static.copy_(value)
