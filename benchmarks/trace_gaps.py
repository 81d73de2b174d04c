"""What the host was doing while the GPU had nothing to run, from a torch.profiler trace.

Reads a chrome trace written by `throughput_profile.py --trace-dir` (CPU ops, Python calls
and CUDA kernels of a few engine steps), finds the intervals in which no kernel, copy or
memset ran on any stream, and attributes each idle millisecond to the innermost kvloom
Python function running on the host at that moment (sampled every 50 µs). Prints the GPU's
busy and idle time and the functions that idle time falls in.

    python benchmarks/trace_gaps.py trace/step300.json.gz [--top 25] [--min-gap-us 20]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# A frame's file: an absolute path, or relative to where the benchmark ran (the repo root).
OURS = re.compile(r"(^|/)(kvloom|cluster|workers|kernels|contracts|benchmarks)/")


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """The union of the device's work intervals (µs), sorted."""
    spans = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") in DEVICE_CATEGORIES
    )
    merged: list[list[float]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def idle_gaps(busy, min_gap_us: float) -> list[tuple[float, float]]:
    return [(a[1], b[0]) for a, b in zip(busy, busy[1:]) if b[0] - a[1] >= min_gap_us]


class HostFrames:
    """kvloom's Python calls on the host, for asking which one was innermost at a time."""

    def __init__(self, events: list[dict]):
        calls = [
            (e["ts"], e["ts"] + e.get("dur", 0), e["name"])
            for e in events
            if e.get("cat") == "python_function" and OURS.search(e["name"])
        ]
        calls.sort()
        self.calls = calls
        self.starts = [c[0] for c in calls]

    def innermost(self, t: float) -> str:
        """The latest-starting call that contains t (the innermost on one thread)."""
        i = bisect.bisect_right(self.starts, t)
        best = None
        for lo, hi, name in reversed(self.calls[max(0, i - 5000) : i]):
            if lo <= t <= hi:
                best = name
                break
        return best or "(no kvloom frame)"


def summarize(trace: dict, min_gap_us: float, sample_us: float = 50.0) -> dict:
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    busy = busy_intervals(events)
    if not busy:
        return {"busy_ms": 0.0, "idle_ms": 0.0, "span_ms": 0.0, "idle_by_function_ms": {}}
    gaps = idle_gaps(busy, min_gap_us)
    frames = HostFrames(events)
    by_function: dict[str, float] = defaultdict(float)
    for lo, hi in gaps:
        t = lo
        while t < hi:
            step = min(sample_us, hi - t)
            by_function[frames.innermost(t + step / 2)] += step / 1e3
            t += step
    span = busy[-1][1] - busy[0][0]
    busy_us = sum(hi - lo for lo, hi in busy)
    ranked = sorted(by_function.items(), key=lambda kv: -kv[1])
    return {
        "span_ms": span / 1e3,
        "busy_ms": busy_us / 1e3,
        "idle_ms": sum(hi - lo for lo, hi in gaps) / 1e3,
        "num_gaps": len(gaps),
        "idle_by_function_ms": {name: round(ms, 3) for name, ms in ranked},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--min-gap-us", type=float, default=20.0)
    args = parser.parse_args(argv)
    opener = gzip.open if args.trace.suffix == ".gz" else open
    with opener(args.trace, "rt") as f:
        result = summarize(json.load(f), args.min_gap_us)
    print(
        f"span {result['span_ms']:.2f} ms, GPU busy {result['busy_ms']:.2f} ms, idle "
        f"{result['idle_ms']:.2f} ms in {result.get('num_gaps', 0)} gaps of >= "
        f"{args.min_gap_us:g} us"
    )
    for name, ms in list(result["idle_by_function_ms"].items())[: args.top]:
        print(f"  {ms:9.3f} ms  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
