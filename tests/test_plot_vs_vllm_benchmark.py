"""benchmarks/plot_vs_vllm.py: the ratios come from the recorded runs, and the committed
summary JSON is what the script makes of them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import plot_vs_vllm  # noqa: E402


def test_ratios_are_read_from_the_recorded_runs():
    rows = {(r["workload"], r["kvloom_lease"]): r for r in plot_vs_vllm.summary()}
    offline = rows[("Qwen3-Next-16l offline (bf16 state)", "twenty-eighth")]
    assert (offline["kvloom"], offline["vllm"], offline["unit"]) == (28.65, 51.36, "s")
    assert offline["speed_vs_vllm"] == round(51.36 / 28.65, 3) and offline["same_lease"]
    kimi = rows[("Kimi-Linear-16l offline", "thirtieth")]
    assert kimi["vllm"] == 53.32 and not kimi["same_lease"]
    assert rows[("Qwen3-8B batch-1", "twenty-first")]["unit"] == "ms/token"
    assert all(r["device"] == "NVIDIA H100 80GB HBM3" for r in rows.values())


def test_the_committed_summary_is_current():
    committed = json.loads((plot_vs_vllm.DATA / "vs_vllm_latest_h100.json").read_text())
    assert committed == plot_vs_vllm.summary()


def test_a_vllm_key_must_appear_with_one_value():
    log = "RESULT b_wall_s 36.08\nnoise\nRESULT b_wall_s 36.08\nRESULT a_ms 6.8\n"
    assert plot_vs_vllm.vllm_result(log, "b_wall_s") == 36.08
    with pytest.raises(ValueError, match="RESULT missing"):
        plot_vs_vllm.vllm_result(log, "missing")
    with pytest.raises(ValueError, match="RESULT b_wall_s"):
        plot_vs_vllm.vllm_result(log + "RESULT b_wall_s 40.0\n", "b_wall_s")
