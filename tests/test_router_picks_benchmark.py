"""benchmarks/router_picks.py: both routers, both pick plans, the same bits, in the JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import router_picks  # noqa: E402


def test_every_router_and_plan_is_timed_and_compared(tmp_path, monkeypatch):
    out = tmp_path / "picks.json"
    monkeypatch.setattr(sys, "argv", ["router_picks.py", "--tokens", "1", "--out", str(out)])
    assert router_picks.main() == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["router"], r["picks_per_round"]) for r in rows] == [
        ("qwen3-next softmax 512/10", 1),
        ("qwen3-next softmax 512/10", 2),
        ("kimi-linear sigmoid 256/8", 1),
        ("kimi-linear sigmoid 256/8", 2),
    ]
    assert all(r["same_bits"] and r["us"] > 0 and r["tokens"] == 1 for r in rows)
