"""benchmarks/peer_vllm_shape.py: the peer kit's hybrid bench on a kvloom bench shape."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvloom.cluster.bench import shape_config

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import peer_vllm_shape  # noqa: E402

FAKE_KIT = """
CONFIG = {"architectures": ["Qwen3NextForCausalLM"], "hidden_size": 8}
MODEL_DIR = "/tmp/qwen3next-24l-dummy"
printed = []
seen = {}


def res(key, val):
    printed.append((key, val))


def main():
    seen["config"], seen["model_dir"] = CONFIG, MODEL_DIR
    res("a_ms_per_tok_decode", 1.0)
"""


def test_kit_runs_on_kvloom_s_kimi_linear_config(tmp_path, monkeypatch):
    (tmp_path / "bench_hybrid.py").write_text(FAKE_KIT)
    config_path = tmp_path / "kimi.json"
    peer_vllm_shape.main(["write-config", "kimi-linear-16l", str(config_path)])
    written = json.loads(config_path.read_text())
    assert written["kvloom_shape"] == "kimi-linear-16l"
    loaded = {}
    real_load = peer_vllm_shape.load_kit_bench

    def keep(kit_dir):
        loaded["bench"] = real_load(kit_dir)
        return loaded["bench"]

    monkeypatch.setattr(peer_vllm_shape, "load_kit_bench", keep)
    peer_vllm_shape.main(["run", str(tmp_path), str(config_path)])
    bench = loaded["bench"]
    config = bench.seen["config"]
    # kvloom's shape as the bench runs it, plus the dtype vLLM reads; no marker key left.
    assert config == {"torch_dtype": "bfloat16", **shape_config("kimi-linear-16l")}
    assert config["architectures"] == ["KimiLinearForCausalLM"]
    assert bench.seen["model_dir"] == "/tmp/kimi-linear-16l-dummy"
    assert bench.printed == [("kimi-linear-16l_a_ms_per_tok_decode", 1.0)]


def test_missing_kit_is_a_clear_error(tmp_path):
    config_path = tmp_path / "c.json"
    config_path.write_text("{}")
    with pytest.raises(SystemExit, match="build.sh"):
        peer_vllm_shape.main(["run", str(tmp_path / "nowhere"), str(config_path)])
