"""benchmarks/decode_timeline.py: device work split into steps, and each kernel's busy
time and the idle time before its launches."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import decode_timeline  # noqa: E402


def kernel(name, ts, dur, cat="kernel", grid=None):
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    if grid:
        event["args"] = {"grid": grid, "block": [128, 1, 1]}
    return event


def test_steps_are_split_at_long_gaps_and_gaps_charged_to_the_next_launch(tmp_path):
    events = [
        kernel("gemv", 0, 10),
        kernel("norm", 12, 3),  # 2 us after the GEMV
        kernel("gemv", 15, 10),  # back to back
        kernel("copy", 30, 1, cat="gpu_memcpy"),  # 5 us after
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 40, "dur": 500},  # host: ignored
        kernel("gemv", 1000, 10),  # a new step
        kernel("norm", 1011, 3),
    ]
    trace = tmp_path / "t.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    spans = decode_timeline.device_events(trace)
    steps = decode_timeline.split_steps(spans, min_gap_us=200)
    assert [len(s) for s in steps] == [4, 2]
    first = decode_timeline.summarize(steps[0])
    assert first["span_us"] == 31 and first["busy_us"] == 24 and first["gaps_us"] == 7
    rows = {r["name"]: r for r in first["kernels"]}
    assert rows["gemv"] == dict(name="gemv", launches=2, busy_us=20, gap_before_us=0)
    assert rows["norm"]["gap_before_us"] == 2 and rows["copy"]["gap_before_us"] == 5
    assert first["kernels"][0]["name"] == "gemv"  # largest busy + gap first


def test_overlapping_work_counts_no_negative_gap():
    step = [kernel("a", 0, 10), kernel("b", 5, 10), kernel("c", 12, 1)]
    got = decode_timeline.summarize(step)
    assert got["gaps_us"] == 0 and got["span_us"] == 13


def test_launches_are_also_broken_down_by_grid():
    step = [
        kernel("gemv", 0, 10, grid=[96, 1, 1]),
        kernel("norm", 10, 2, grid=[1, 1, 1]),
        kernel("gemv", 12, 4, grid=[16, 1, 1]),
        kernel("gemv", 16, 12, grid=[96, 1, 1]),
        kernel("copy", 30, 1, cat="gpu_memcpy"),
    ]
    shapes = decode_timeline.summarize(step)["launch_shapes"]
    assert shapes == [
        dict(name="gemv", grid="96,1,1", launches=2, busy_us=22, us_per_launch=11),
        dict(name="gemv", grid="16,1,1", launches=1, busy_us=4, us_per_launch=4),
        dict(name="norm", grid="1,1,1", launches=1, busy_us=2, us_per_launch=2),
        dict(name="copy", grid="", launches=1, busy_us=1, us_per_launch=1),
    ]
