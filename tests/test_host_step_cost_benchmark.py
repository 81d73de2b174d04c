"""benchmarks/host_step_cost.py --offline: steps the bench's requests and reports the
collector's work."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import host_step_cost  # noqa: E402


def test_offline_run_reports_collections(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLOOM_GC_YOUNG_THRESHOLD", "1")  # collect at every allocation
    saved = gc.get_threshold()
    out = tmp_path / "row.json"
    try:
        host_step_cost.main(["--rows", "3", "--offline", "--steps", "4", "--out", str(out)])
    finally:
        gc.set_threshold(*saved)
        gc.unfreeze()
    row = json.loads(out.read_text())
    assert row["rows"] == 3 and row["steps"] == 4 and row["gc_threshold"][0] == 1
    assert row["gc_collections_per_generation"][0] > 0 and row["host_ms_per_step"] > 0


def test_phases_are_timed(tmp_path):
    out = tmp_path / "row.json"
    try:
        host_step_cost.main(["--rows", "4", "--steps", "3", "--phases", "--out", str(out)])
    finally:
        gc.unfreeze()
    row = json.loads(out.read_text())
    phases = row["phase_ms_per_step"]
    assert set(phases) == set(host_step_cost.PHASES)
    assert all(ms > 0 for ms in phases.values())
    assert sum(phases.values()) < row["host_ms_per_step"]
