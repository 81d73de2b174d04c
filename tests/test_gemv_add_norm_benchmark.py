"""benchmarks/gemv_add_norm.py: both forms timed at each shape and row count, the same
bits, in the JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import gemv_add_norm  # noqa: E402


def test_both_forms_are_timed_and_compared(tmp_path, monkeypatch):
    out = tmp_path / "gemv_add_norm.json"
    argv = ["gemv_add_norm.py", "--rows", "1", "3", "--shapes", "72,128", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    assert gemv_add_norm.main() == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["rows"], r["form"]) for r in rows] == [
        (1, "two launches"), (1, "fused"), (3, "two launches"), (3, "fused"),
    ]  # fmt: skip
    assert all(r["same_bits"] and r["us"] > 0 and r["n"] == 72 for r in rows)
    # One row fuses with the shape's plan; three exceed the epilogue's rows.
    assert [r["fused_in_one_launch"] for r in rows] == [True, True, False, False]
