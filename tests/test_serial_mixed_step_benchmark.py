"""benchmarks/serial_mixed_step.py: the step it builds, one row per prefill length, and a
digest of the kernels' outputs that the timed calls do not disturb (two trees compare by it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import serial_mixed_step as bench  # noqa: E402


def test_the_step_has_fresh_prompt_rows_then_decodes():
    step = bench.make_step(bench.TINY_SHAPES["tiny"], 3, 2, 5, torch.float32, "cpu", seed=1)
    assert step["cu"].tolist() == [0, 5, 10, 11, 12, 13]
    assert step["has_state"].tolist() == [False, False, True, True, True]
    assert step["slots"].tolist() == list(range(5))
    assert step["g"].shape == (13, 4, 16) and bool((step["g"] <= 0).all())  # KDA's decay


def test_tiny_run_reports_each_length_and_a_stable_digest(tmp_path):
    out = tmp_path / "serial.json"
    args = ["--tiny", "--decode-rows", "2", "--prefill-tokens", "3", "6", "--out", str(out)]
    first = bench.main(args)["rows"]
    again = bench.main(args)["rows"]
    assert [r["prefill_tokens"] for r in first] == [3, 6]
    assert all(r["decode_rows"] == 2 and r["conv_us"] > 0 for r in first)
    assert [r["sha256"] for r in first] == [r["sha256"] for r in again]
    assert first[0]["sha256"] != first[1]["sha256"]
    assert json.loads(out.read_text())["rows"] == again


def test_tilings_report_time_bits_and_difference_beside_the_default():
    args = ["--tiny", "--decode-rows", "2", "--prefill-tokens", "4", "--tilings", "8x1", "16x4"]
    (row,) = bench.main(args)["rows"]
    assert sorted(row["tilings"]) == ["16x4", "8x1"]
    # The tiny head is 16 wide: 16x4 is the default tiling, so the same bits.
    assert row["tilings"]["16x4"]["sha256"] == row["sha256"]
    assert row["tilings"]["16x4"]["max_abs_diff"] == 0.0
    assert all(t["recurrence_us"] > 0 for t in row["tilings"].values())
    assert bench.parse_tiling("16x2") == (16, 2)


def test_the_token_parallel_conv_is_timed_beside_the_serial_loop():
    (row,) = bench.main(["--tiny", "--decode-rows", "3", "--prefill-tokens", "7"])["rows"]
    assert row["conv_parallel_us"] > 0
    assert row["conv_parallel_same_bits"] is True  # the same per-token arithmetic


def test_prenorm_times_the_recurrence_on_normalised_inputs_within_rounding():
    args = ["--tiny", "--decode-rows", "2", "--prefill-tokens", "5", "--prenorm"]
    (row,) = bench.main(args)["rows"]
    assert row["recurrence_prenorm_us"] > 0
    # The same recurrence, the norms summed elsewhere: bf16 outputs within a rounding step.
    assert row["prenorm_max_abs_diff"] < 1e-2
