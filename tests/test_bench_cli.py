"""`kvloom bench` runs on the CPU with a dummy-weight shape and reports sane figures."""

from __future__ import annotations

import json
import math

import pytest

from kvloom import LLM, SamplingParams
from kvloom.cluster.cli import main


def test_bench_latency_reports_bandwidth_fraction(tmp_path):
    out = tmp_path / "latency.json"
    assert (
        main(
            [
                "bench",
                "latency",
                "--shape",
                "tiny",
                "--dtype",
                "float32",
                "--steps",
                "4",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["ms_per_token"] > 0 and result["tokens_per_s"] > 0
    # 4 layers of the tiny shape in fp32, LM head included, embedding table excluded
    assert result["weight_bytes_per_step"] > 4 * 4 * 256 * 256
    assert 0 < result["fraction_of_floor"] < 1.5


@pytest.mark.parametrize("executor", ["inprocess", "ray"])
def test_bench_throughput(tmp_path, executor):
    out = tmp_path / "throughput.json"
    assert (
        main(
            [
                "bench",
                "throughput",
                "--executor",
                executor,
                "--shape",
                "tiny",
                "--dtype",
                "float32",
                "--num-requests",
                "4",
                "--prompt-len",
                "8",
                "16",
                "--output-len",
                "4",
                "8",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["requests"] == 4 and result["output_tokens_per_s"] > 0
    assert result["executor"] == executor
    # The first run's schedule: a step per output token of the longest request at least
    # (4-8 tokens each), a prefill step and 8 decode steps per request at most.
    assert 4 <= result["steps"] <= 4 * (1 + 8)
    # 4 prompts of 8-16 tokens and 4 outputs of 4-8, over those steps.
    assert 48 <= round(result["tokens_per_step"] * result["steps"]) <= 96
    assert result["preemptions"] == 0 and result["kv_pool_blocks"] > 0
    assert result["block_size"] > 0
    # The floor (cluster/offline_floor.py) from rank 0's weights and rates: a lower bound.
    assert result["matmul_flops"] > 2 * 4 * 4 * 256 * 256 * (8 + 4 - 1)
    assert result["decode_kv_bytes"] > 0 and result["prefill_attention_flops"] > 0
    assert 0 < result["floor_seconds"] < result["seconds"]
    parts = result["floor_compute_seconds"] + result["floor_decode_attention_seconds"]
    assert result["floor_seconds"] == pytest.approx(parts, abs=2e-4)
    assert 0 < result["fraction_of_floor"] < 1
    if executor == "ray":
        from kvloom.cluster.ray_local import shutdown_ray

        shutdown_ray()  # the embedded Ray this run started: later modules start their own


def test_bench_throughput_repeats_on_one_engine(tmp_path):
    out = tmp_path / "throughput.json"
    args = ["bench", "throughput", "--shape", "tiny", "--dtype", "float32"]
    args += ["--num-requests", "3", "--prompt-len", "8", "16", "--output-len", "4", "8"]
    assert main(args + ["--repeat", "3", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    runs = result["seconds_per_run"]
    assert len(runs) == 3 and all(s > 0 for s in runs) and result["seconds"] == runs[0]


@pytest.mark.parametrize(
    "args, match",
    [
        (["throughput", "--repeat", "0"], "--repeat must be >= 1"),
        (["latency", "--repeat", "2"], "--repeat applies to throughput"),
    ],
)
def test_bad_repeat_is_refused(args, match):
    with pytest.raises(SystemExit, match=match):
        main(["bench", *args, "--shape", "tiny"])


def test_unknown_shape_is_refused():
    with pytest.raises(ValueError, match="shape"):
        main(["bench", "latency", "--shape", "gpt-9"])


def test_dummy_load_format_needs_no_weights(tiny_model, tmp_path):
    import shutil

    path = tmp_path / "m"
    shutil.copytree(tiny_model("llama"), path)
    (path / "model.safetensors").unlink()
    llm = LLM(str(path), load_format="dummy", progress=False)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="load_format"):
        LLM(str(path), load_format="pickle", progress=False)


def test_offline_workload_is_the_peer_kits():
    """The throughput workload draws exactly as ../shared/tools/peer-vllm/bench.py does
    (its run logged 590,325 prompt and 292,020 output tokens for these settings)."""
    import argparse

    from kvloom.cluster.bench import offline_workload

    args = argparse.Namespace(prompt_len=(128, 1024), output_len=(64, 512), num_requests=1000)
    requests = offline_workload(args, 151936)
    assert len(requests) == 1000
    assert sum(len(p) for p, _ in requests) == 590325
    assert sum(n for _, n in requests) == 292020
    assert all(0 <= t < 151936 for p, _ in requests[:20] for t in p)


def test_decode_bytes_count_active_experts_only():
    """Bytes a batch-1 decode step must read (the floor's numerator), on meta tensors: the
    Qwen3-8B shape's 15.14 GB (the peer kit's figure) and, for the hybrid MoE shape, only
    the routed top-k of its 512 experts (the kit's ≈ 3.87 GB of its 40.1 B parameters)."""
    import torch

    from kvloom.cluster.bench import SHAPES, decode_weight_bytes
    from kvloom.workers.models.registry import model_class

    def build(shape):
        config = SHAPES[shape]
        with torch.device("meta"):
            return model_class(config["architectures"][0])(config, torch.bfloat16)

    assert decode_weight_bytes(build("qwen3-8b")) == 15_136_811_008
    hybrid = build("qwen3-next-24l")
    assert abs(sum(p.numel() for p in hybrid.parameters()) / 1e9 - 40.1) < 0.1
    assert abs(decode_weight_bytes(hybrid) / 1e9 - 3.87) < 0.01
    # The 16-layer cut fits an 80 GB card: two thirds of the layers, the same vocabulary.
    small = build("qwen3-next-16l")
    assert sum(p.numel() for p in small.parameters()) * 2 / 2**30 < 52
    kinds = [layer.kind for layer in small.model.layers]
    assert kinds == (["linear_attention"] * 3 + ["full_attention"]) * 4


def test_serve_flags_reach_the_engine_config(tiny_model):
    from kvloom.cluster.cli import build_parser
    from kvloom.cluster.commands.serve import engine_kwargs
    from kvloom.contracts.config import EngineConfig

    path = str(tiny_model("llama"))
    args = build_parser().parse_args(["serve", "--model", path])
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert config.model.enforce_eager is False and config.scheduler.async_scheduling is None
    flags = ["serve", "--model", path, "--enforce-eager", "--no-async-scheduling"]
    config = EngineConfig.from_kwargs(**engine_kwargs(build_parser().parse_args(flags)))
    assert config.model.enforce_eager is True and config.scheduler.async_scheduling is False


def test_bench_load_reports_ttft_and_tpot_percentiles(tmp_path):
    out = tmp_path / "load.json"
    args = ["bench", "load", "--shape", "tiny", "--dtype", "float32", "--num-requests", "6"]
    args += ["--request-rate", "40", "--prompt-len", "8", "16", "--output-len", "4", "8"]
    assert main([*args, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["requests"] == 6 and result["request_rate"] == 40
    for name in ("ttft", "tpot"):
        p50, p90, p99 = (result[f"{name}_p{q}_ms"] for q in (50, 90, 99))
        assert 0 < p50 <= p90 <= p99
    # Six arrivals at 40/s span about 0.15 s: the run cannot end before the last arrives.
    assert result["seconds"] > 0


def test_load_needs_a_request_rate():
    with pytest.raises(ValueError, match="request-rate"):
        main(["bench", "load", "--shape", "tiny", "--num-requests", "2"])


def test_percentiles_are_nearest_rank_in_ms():
    from kvloom.cluster.bench import percentiles

    values = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    got = percentiles(values, "x")
    assert (got["x_p50_ms"], got["x_p90_ms"], got["x_p99_ms"]) == (50.0, 90.0, 99.0)
    assert got["x_mean_ms"] == 50.5 and percentiles([], "x") == {}


def test_bench_latency_runs_on_a_demo_model_directory(tmp_path):
    """--model with a small vocabulary (the demo's 512 ids): the prompt stays inside it."""
    from kvloom.cluster.demo_model import write_demo_model

    model = write_demo_model(tmp_path / "demo", arch="llama")
    out = tmp_path / "latency.json"
    args = ["bench", "latency", "--model", str(model), "--dtype", "float32", "--steps", "4"]
    assert main([*args, "--out", str(out)]) == 0
    assert json.loads(out.read_text())["ms_per_token"] > 0


@pytest.mark.parametrize(
    ("quantization", "code_dtype", "scale_name", "scale"),
    [
        ("fp8", "float8_e4m3fn", "weight_scale_inv", 0.02),
        ("w4a16", "int32", "weight_scale", 0.005),
        ("awq", "int32", "weight_scale", 0.005),  # and a weight_offset per group
    ],
)
def test_quantized_shape_gets_quantized_dummy_weights(
    tmp_path, quantization, code_dtype, scale_name, scale
):
    """`--quantization` benches the checkpoint format's kernels: every projection holds
    codes and scales (the LM head stays float, as the published checkpoints keep it), and
    the random codes give finite, varied logits."""
    from kvloom import Engine
    from kvloom.cluster.bench import shape_dir

    engine = Engine(
        model=str(shape_dir("tiny", tmp_path, quantization)),
        dtype="bfloat16",
        load_format="dummy",
        max_model_len=256,
        progress=False,
    )
    model = engine.executor.worker.runner.model
    params = dict(model.named_parameters())
    codes = [n for n, p in params.items() if str(p.dtype) == f"torch.{code_dtype}"]
    assert len(codes) == 4 * 4  # qkv, o, gate_up, down in each of 4 layers
    scales = [p for n, p in params.items() if n.endswith(scale_name)]
    assert len(scales) == len(codes) and all(bool((p == scale).all()) for p in scales)
    assert not any(n.startswith("lm_head") for n in codes)
    offsets = [n for n in params if n.endswith("weight_offset")]
    assert len(offsets) == (len(codes) if quantization == "awq" else 0)
    sampling = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2)
    engine.add_request("r", {"prompt_token_ids": list(range(1, 20))}, sampling)
    while engine.has_unfinished_requests():
        outputs = engine.step()
    logprobs = [v for step in outputs[0].outputs[0].logprobs for v in step.values()]
    values = [getattr(v, "logprob", v) for v in logprobs]
    assert all(math.isfinite(v) for v in values) and len(set(values)) > 1


def test_quantization_is_refused_with_a_model_dir(tiny_model):
    with pytest.raises(SystemExit, match="--quantization"):
        main(["bench", "latency", "--model", str(tiny_model("llama")), "--quantization", "fp8"])


def test_kimi_linear_shape_loads_in_its_checkpoint_spelling(tmp_path):
    """The kimi-linear-16l shape writes Kimi-Linear's own config fields; shrunk to CPU
    widths (every field name kept), the model built from it has KDA and MLA layers in the
    shape's pattern, a dense first MLP, and generates finite logits."""
    import json

    from kvloom import Engine
    from kvloom.cluster.bench import SHAPES, shape_dir

    real = SHAPES["kimi-linear-16l"]
    assert real["linear_attn_config"]["full_attn_layers"] == [4, 8, 12, 16]
    assert len(real["linear_attn_config"]["kda_layers"]) == 12
    path = shape_dir("kimi-linear-16l", tmp_path)
    small = dict(real, hidden_size=64, intermediate_size=96, moe_intermediate_size=32)
    small.update(num_attention_heads=2, num_key_value_heads=2, num_experts=4, vocab_size=512)
    small.update(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    small["num_experts_per_token"] = 2
    small["linear_attn_config"] = dict(real["linear_attn_config"], num_heads=2, head_dim=16)
    (path / "config.json").write_text(json.dumps(small))
    engine = Engine(
        model=str(path), dtype="float32", load_format="dummy", max_model_len=128, progress=False
    )
    model = engine.executor.worker.runner.model
    kinds = [type(layer.self_attn).__name__ for layer in model.model.layers]
    assert len(kinds) == 16 and len(set(kinds[3::4])) == 1 and kinds[3] != kinds[0]
    assert set(kinds) - {kinds[3]} == {kinds[0]}
    sampling = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2)
    engine.add_request("r", {"prompt_token_ids": list(range(1, 12))}, sampling)
    while engine.has_unfinished_requests():
        outputs = engine.step()
    values = [getattr(v, "logprob", v) for s in outputs[0].outputs[0].logprobs for v in s.values()]
    assert len(outputs[0].outputs[0].token_ids) == 3 and all(math.isfinite(v) for v in values)
