"""The kernel benchmarks' timer: µs per call of `fn` captured `repeats` times in one CUDA
graph (no host overhead, as the decode graphs run kernels), after a warm-up call on a side
stream (compiles stay outside the capture) and a warm-up replay, timed by CUDA events."""

from __future__ import annotations

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
