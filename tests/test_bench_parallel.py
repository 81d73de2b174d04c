"""`kvloom bench --tp/--dcp`: every kind runs a TP × DCP grid through the Ray executor (CPU
workers over gloo on a loopback local Ray), records the grid, and refuses grids and lengths
that cannot run before anything starts."""

from __future__ import annotations

import json

import pytest

from kvloom.cluster.cli import main

TINY = ["--shape", "tiny", "--dtype", "float32", "--max-model-len", "256"]


def bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "result.json"
    assert main(["bench", *args, *TINY, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_throughput_at_tp2_runs_on_ray(local_ray, tmp_path):
    result = bench(
        tmp_path,
        "throughput",
        "--tp",
        "2",
        "--num-requests",
        "3",
        "--prompt-len",
        "8",
        "16",
        "--output-len",
        "4",
        "6",
    )
    assert (result["tp"], result["dcp"], result["executor"]) == (2, 1, "ray")
    assert result["requests"] == 3 and result["output_tokens_per_s"] > 0


def test_latency_at_tp2_measures_rank0_shard(local_ray, tmp_path):
    """Latency through the Ray executor's step loop: every decoded token is timed, and the
    weight bytes are one rank's shard, about half the single rank's."""
    single = bench(tmp_path, "latency", "--steps", "5", "--context-len", "20")
    sharded = bench(tmp_path, "latency", "--tp", "2", "--steps", "5", "--context-len", "20")
    assert (single["tp"], single["executor"]) == (1, "inprocess")
    assert (sharded["tp"], sharded["dcp"], sharded["executor"]) == (2, 1, "ray")
    for result in (single, sharded):
        assert result["decode_tokens"] == 5 and result["context_len"] == 20
        assert result["ms_per_token"] > 0 and result["copy_bandwidth_GBps"] > 0
    ratio = sharded["weight_bytes_per_step"] / single["weight_bytes_per_step"]
    assert 0.45 < ratio < 0.6  # the LM head and projections split; norms are replicated


def test_latency_at_dcp2_runs_on_ray(local_ray, tmp_path):
    result = bench(tmp_path, "latency", "--dcp", "2", "--steps", "3", "--context-len", "40")
    assert (result["tp"], result["dcp"], result["executor"]) == (1, 2, "ray")
    assert result["decode_tokens"] == 3


@pytest.mark.parametrize(
    "args, error, match",
    [
        (["throughput", "--tp", "3"], ValueError, r"--tp 3 must divide num_attention_heads \(8\)"),
        (["latency", "--tp", "0"], SystemExit, "--tp and --dcp must be >= 1"),
        (["throughput", "--tp", "2", "--executor", "inprocess"], SystemExit, "Ray executor"),
        (["latency", "--context-len", "300"], SystemExit, r"--max-model-len >= 812"),
    ],
)
def test_bad_grid_or_length_is_refused_before_start(args, error, match):
    with pytest.raises(error, match=match):
        main(["bench", *args, "--shape", "tiny", "--max-model-len", "256"])


def test_kv_heads_must_split_evenly():
    from kvloom.cluster.bench import check_grid

    with pytest.raises(ValueError, match=r"num_key_value_heads \(6\)"):
        check_grid({"num_attention_heads": 12, "num_key_value_heads": 6}, 4, 1)
    check_grid({"num_attention_heads": 64, "num_key_value_heads": 8}, 16, 1)  # kv replicated


def test_long_context_stretches_the_shape_rope(tmp_path):
    """A context past the shape's 40,960 positions (Qwen3's YaRN range) gets linear rope
    scaling by the next whole factor; within the limit the config is untouched."""
    from kvloom.cluster.bench import SHAPES, extend_context, shape_dir

    config = json.loads(
        (shape_dir("qwen3-32b", tmp_path, context_len=131072) / "config.json").read_text()
    )
    assert config["max_position_embeddings"] == 4 * 40960
    assert config["rope_parameters"] == {
        "rope_type": "linear",
        "factor": 4.0,
        "rope_theta": 1000000.0,
    }
    assert extend_context(SHAPES["qwen3-32b"], 32768) == SHAPES["qwen3-32b"]


def test_qwen3_32b_shape_builds_to_its_parameter_count():
    """On meta tensors: Qwen3-32B's 32.8 B parameters (its model card), and a TP-2 shard
    check passes where TP-3 (64 heads) is refused."""
    import torch

    from kvloom.cluster.bench import SHAPES, check_grid
    from kvloom.workers.models.registry import model_class

    config = SHAPES["qwen3-32b"]
    with torch.device("meta"):
        model = model_class(config["architectures"][0])(config, torch.bfloat16)
    assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - 32.8) < 0.05
    check_grid(config, 8, 1)
    with pytest.raises(ValueError, match="--tp 3"):
        check_grid(config, 3, 1)
