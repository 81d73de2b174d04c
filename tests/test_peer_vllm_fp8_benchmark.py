"""benchmarks/peer_vllm_fp8.py: the peer kit's bench run on an FP8 copy of its config."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import peer_vllm_fp8  # noqa: E402

FAKE_KIT = """
CONFIG = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 8}
MODEL_DIR = "/tmp/model"
printed = []
seen = {}


def res(key, val):
    printed.append((key, val))


def mode_vllm():
    seen["config"], seen["model_dir"] = CONFIG, MODEL_DIR
    res("a_ms_per_tok_decode", 1.0)
"""


def test_kit_runs_on_the_checkpoint_fp8_config(tmp_path, monkeypatch):
    (tmp_path / "bench.py").write_text(FAKE_KIT)
    loaded = {}
    real_load = peer_vllm_fp8.load_kit_bench

    def keep(kit_dir):
        loaded["bench"] = real_load(kit_dir)
        return loaded["bench"]

    monkeypatch.setattr(peer_vllm_fp8, "load_kit_bench", keep)
    peer_vllm_fp8.main([str(tmp_path)])
    bench = loaded["bench"]
    quant = bench.seen["config"]["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["weight_block_size"] == [128, 128]
    assert bench.seen["config"]["hidden_size"] == 8  # the kit's shape, unchanged
    assert bench.seen["model_dir"] == "/tmp/model-fp8-block"  # not the bf16 run's folder
    assert bench.printed == [("fp8_scheme", "fp8-block"), ("fp8_a_ms_per_tok_decode", 1.0)]


def test_missing_kit_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="build.sh"):
        peer_vllm_fp8.main([str(tmp_path / "nowhere")])
