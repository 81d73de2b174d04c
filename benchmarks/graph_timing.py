"""The kernel benchmarks' timer: µs per call of `fn` captured `repeats` times in one CUDA
graph (no host overhead, as the decode graphs run kernels), after a warm-up call on a side
stream (compiles stay outside the capture) and a warm-up replay, timed by CUDA events;
and the JSON result the kernel benchmarks write."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch


def graph_time_us(fn, repeats: int, replays: int = 1) -> float:
    """µs per call; with `replays` > 1, the best of that many timed replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / repeats)
    return best


def launch_us(fn, repeats: int, replays: int = 1) -> float:
    """graph_time_us on a GPU; without CUDA the wall time of one call (the CPU
    interpreter: that only exercises a benchmark, it times nothing)."""
    if torch.cuda.is_available():
        return graph_time_us(fn, repeats, replays)
    began = time.perf_counter()
    fn()
    return (time.perf_counter() - began) * 1e6


def write_result(out: Path | None, start: float, rows: list[dict], **fields) -> dict:
    """A kernel benchmark's result: the device, torch, how it was timed (a CUDA graph, or
    the CPU interpreter's wall clock), `fields`, the rows and the seconds since `start`
    (time.monotonic); prints the seconds and writes the JSON to `out` when given."""
    cuda = torch.cuda.is_available()
    result = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "timing": "cuda_graph" if cuda else "cpu_interpreter_wall",
        **fields,
        "rows": rows,
        "elapsed_s": time.monotonic() - start,
    }
    print(f"elapsed_s {result['elapsed_s']:.1f}")
    if out:
        out.write_text(json.dumps(result, indent=2))
    return result
