"""benchmarks/trace_gaps.py: idle device time found and charged to the host's frame."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import trace_gaps  # noqa: E402


def kernel(ts, dur):
    return {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur}


def frame(ts, dur, name):
    return {"ph": "X", "cat": "python_function", "name": name, "ts": ts, "dur": dur}


def test_idle_time_is_charged_to_the_innermost_kvloom_frame():
    events = [
        kernel(0, 100),
        kernel(50, 100),  # overlaps the first: busy 0-150
        kernel(400, 100),  # idle 150-400
        kernel(510, 90),  # a 10 us gap: below the threshold
        frame(100, 400, "/repo/cluster/engine_core.py(205): _step"),
        frame(140, 160, "/repo/workers/model_runner.py(520): build_batch"),
        frame(150, 50, "torch/nn/modules/module.py(1): _call_impl"),  # not ours
    ]
    got = trace_gaps.summarize({"traceEvents": events}, min_gap_us=20, sample_us=10)
    assert abs(got["busy_ms"] - 0.34) < 1e-9 and got["num_gaps"] == 1
    assert abs(got["idle_ms"] - 0.25) < 1e-9
    by = got["idle_by_function_ms"]
    # 150-300 inside build_batch, 300-400 only inside _step
    assert abs(by["/repo/workers/model_runner.py(520): build_batch"] - 0.15) < 1e-9
    assert abs(by["/repo/cluster/engine_core.py(205): _step"] - 0.10) < 1e-9


def test_a_trace_without_device_work_reports_nothing_idle():
    got = trace_gaps.summarize({"traceEvents": [frame(0, 10, "/repo/cluster/x.py(1): f")]}, 20)
    assert got["busy_ms"] == 0.0 and got["idle_by_function_ms"] == {}
