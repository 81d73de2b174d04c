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


PRINTING_KIT = """
import sys

CONFIG = {"num_hidden_layers": 24}
MODEL_DIR = "/tmp/qwen3next-24l-dummy"


def res(key, val):
    print(f"RESULT {key} {val}", flush=True)


def main():
    res("layers", CONFIG["num_hidden_layers"])
    res("model_dir", MODEL_DIR)
    res("kvloom_imported", any(name.startswith("kvloom") for name in sys.modules))
"""


def test_written_kit_runs_the_kit_s_script_on_the_shape(tmp_path):
    import subprocess

    kit = tmp_path / "c3"
    kit.mkdir()
    (kit / "bench_hybrid.py").write_text(PRINTING_KIT)
    (kit / "run_hybrid.sh").write_text("python3 $(dirname $0)/bench_hybrid.py\n")
    (kit / "moe_sm90.tar.xz").write_bytes(b"\x00kernels")
    out = tmp_path / "c3-qwen3-next-16l"
    peer_vllm_shape.main(["write-kit", "qwen3-next-16l", str(kit), str(out)])
    # The kit's other files travel unchanged; its bench is kept beside the launcher.
    assert (out / "moe_sm90.tar.xz").read_bytes() == b"\x00kernels"
    assert (out / "run_hybrid.sh").read_text() == (kit / "run_hybrid.sh").read_text()
    assert (out / "kit_bench_hybrid.py").read_text() == PRINTING_KIT
    # Run as the kit runs it, from elsewhere, in a Python that is never given kvloom.
    ran = subprocess.run(
        [sys.executable, "-I", str(out / "bench_hybrid.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert ran.stdout.splitlines() == [
        "RESULT qwen3-next-16l_layers 16",
        "RESULT qwen3-next-16l_model_dir /tmp/qwen3-next-16l-dummy",
        "RESULT qwen3-next-16l_kvloom_imported False",
    ]


def test_write_kit_needs_the_kit_s_hybrid_folder(tmp_path):
    with pytest.raises(SystemExit, match="run_hybrid.sh"):
        peer_vllm_shape.main(["write-kit", "qwen3-next-16l", str(tmp_path), str(tmp_path / "o")])


LLM_KIT = """
CONFIG = {}
MODEL_DIR = "/tmp/qwen3next-24l-dummy"
printed = []


def res(key, val):
    printed.append((key, val))


def main():
    from vllm import LLM

    LLM(model=MODEL_DIR, max_model_len=4096, gpu_memory_utilization=0.85)
"""


def test_engine_args_reach_the_kit_s_llm_and_are_reported(tmp_path, monkeypatch):
    import types

    built = []
    fake_vllm = types.ModuleType("vllm")

    def kit_llm(**kwargs):
        built.append(kwargs)

    fake_vllm.LLM = kit_llm
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    (tmp_path / "bench_hybrid.py").write_text(LLM_KIT)
    config_path = tmp_path / "kimi.json"
    peer_vllm_shape.main(
        ["write-config", "kimi-linear-16l", str(config_path)]
        + ["--engine-arg", "max_num_seqs=128", "--engine-arg", "gpu_memory_utilization=0.9"]
    )
    loaded = {}
    real_load = peer_vllm_shape.load_kit_bench
    monkeypatch.setattr(
        peer_vllm_shape, "load_kit_bench", lambda d: loaded.setdefault("b", real_load(d))
    )
    peer_vllm_shape.main(["run", str(tmp_path), str(config_path)])
    # Added to the kit's own arguments (overriding where both name one), numbers as numbers.
    assert built == [
        {
            "model": "/tmp/kimi-linear-16l-dummy",
            "max_model_len": 4096,
            "gpu_memory_utilization": 0.9,
            "max_num_seqs": 128,
        }
    ]
    bench = loaded["b"]
    assert bench.printed == [
        ("kimi-linear-16l_engine_args", '{"gpu_memory_utilization": 0.9, "max_num_seqs": 128}')
    ]
    assert "kvloom_engine_args" not in bench.CONFIG  # not in the model's config.json
    assert fake_vllm.LLM is kit_llm  # put back after the run


def test_engine_arg_needs_key_equals_value(tmp_path):
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        peer_vllm_shape.main(
            ["write-config", "kimi-linear-16l", str(tmp_path / "c.json"), "--engine-arg", "128"]
        )
