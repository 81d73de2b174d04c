"""benchmarks/router_gemv.py: both forms timed at each row count, the same bits, in the JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import router_gemv  # noqa: E402


def test_both_forms_are_timed_and_compared(tmp_path, monkeypatch):
    out = tmp_path / "router_gemv.json"
    argv = ["router_gemv.py", "--rows", "1", "2", "--n", "41", "--k", "128", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    assert router_gemv.main() == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["rows"], r["form"]) for r in rows] == [
        (1, "two launches"), (1, "fused"), (2, "two launches"), (2, "fused"),
    ]  # fmt: skip
    assert all(r["same_bits"] and r["us"] > 0 and r["n"] == 41 for r in rows)
    assert all(r["fused_in_one_launch"] for r in rows), rows  # the shape's plan fuses
