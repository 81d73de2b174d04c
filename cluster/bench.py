"""`kvloom bench`: decode latency against the memory-bandwidth floor, and offline throughput.

Model shapes of real models run with seeded random weights (`load_format="dummy"`), so a
benchmark needs only a config. Workloads follow the GPU issue's definitions:
- latency: one request, 128-token prompt, N decode steps; ms per token, tokens/s, achieved
  GB/s = bytes of weights read per step (embedding table excluded) / step time, and its
  ratio to the device's copy bandwidth measured in the same run;
- throughput: 1000 requests, prompts U[128, 1024], outputs U[64, 512], seed 0, ignore_eos;
- load: the same requests arriving as a Poisson process at `--request-rate` per second;
  time to first token (from each request's arrival) and time per output token after the
  first (its mean inter-token latency), as percentiles over the requests.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvloom.cluster.engine import Engine
from kvloom.contracts.gc_freeze import freeze_startup_objects
from kvloom.contracts.sampling_params import SamplingParams

SHAPES = {
    "tiny": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "vocab_size": 2048,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": False,
    },
    # Qwen3-Next's widths and layer pattern (3 Gated DeltaNet : 1 gated attention), 24 of
    # its 48 layers so it fits one GPU, as the peer kit's hybrid shape.
    "qwen3-next-24l": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": 2048,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "vocab_size": 151936,
        "intermediate_size": 5120,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "partial_rotary_factor": 0.25,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0},
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 6,
        "full_attention_interval": 4,
        "tie_word_embeddings": False,
    },
    # Kimi-Linear-48B-A3B's widths in its checkpoint's own field names (3 KDA : 1 MLA, NoPE
    # MLA, 256 sigmoid-routed experts, top 8, one shared expert, the first layer dense), 16
    # of its 27 layers: about 28 B parameters in bf16.
    "kimi-linear-16l": {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "hidden_size": 2304,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 72,
        "vocab_size": 163840,
        "intermediate_size": 9216,
        "moe_intermediate_size": 1024,
        "num_experts": 256,
        "num_experts_per_token": 8,
        "num_shared_experts": 1,
        "num_expert_group": 1,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 2.446,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "linear_attn_config": {
            "kda_layers": [i for i in range(1, 17) if i % 4],
            "full_attn_layers": [4, 8, 12, 16],
            "num_heads": 32,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
        },
        "model_max_length": 1048576,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
}


# The `quantization_config` a shape gets with `--quantization`, as the published
# checkpoints write it: Qwen3-8B-FP8's block-scaled FP8 (its lm_head stays bf16), and
# llm-compressor's W4A16 (int4, group 128, symmetric) on every Linear but lm_head.
QUANTIZATION_CONFIGS = {
    "fp8": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head"],
    },
    "w4a16": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": 128,
                },
                "input_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ["lm_head"],
    },
}


def shape_dir(shape: str, root: Path, quantization: str | None = None) -> Path:
    """A checkpoint dir with only config.json and the demo tokenizer (weights are dummy);
    `quantization` (fp8, w4a16) adds that format's `quantization_config`."""
    from kvloom.cluster.demo_model import write_demo_model

    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    config = dict(SHAPES[shape])
    if quantization:
        if quantization not in QUANTIZATION_CONFIGS:
            raise ValueError(
                f"quantization must be one of {sorted(QUANTIZATION_CONFIGS)}, got {quantization!r}"
            )
        config["quantization_config"] = QUANTIZATION_CONFIGS[quantization]
    out = root / shape
    write_demo_model(out, arch="llama")  # for its tokenizer files; config replaced below
    (out / "model.safetensors").unlink()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def copy_bandwidth(device: torch.device) -> float:
    """Device copy bandwidth in bytes/s (read + write), median of 5."""
    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * n / sorted(times[1:])[2]


def weight_bytes(engine: Engine) -> int:
    return decode_weight_bytes(engine.executor.worker.runner.model)


def decode_weight_bytes(model) -> int:
    """Bytes a batch-1 decode step reads: every parameter but the input embedding table,
    and of a mixture of experts only the `top_k` experts one token is routed to (plus a
    shared expert folded into its stacks, which every token reads)."""
    total = 0
    expert_params = set()
    for module in model.modules():
        experts, top_k = getattr(module, "num_experts", None), getattr(module, "top_k", None)
        if experts and top_k and hasattr(module, "w13"):
            folded = int(getattr(module, "shared_expert_id", None) is not None)
            for p in module.parameters():
                expert_params.add(id(p))
                total += p.numel() * p.element_size() * (top_k + folded) // (experts + folded)
    for name, p in model.named_parameters():
        if "embed_tokens" not in name and id(p) not in expert_params:
            total += p.numel() * p.element_size()
    return total


def make_engine(model: str, args) -> Engine:
    engine = Engine(
        model=model,
        dtype=args.dtype,
        load_format=args.load_format,
        progress=False,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        executor=getattr(args, "executor", "inprocess"),
        enforce_eager=getattr(args, "enforce_eager", False),
        max_cuda_graph_batch_size=getattr(args, "max_cuda_graph_batch_size", 1024),
        enable_prefix_caching=getattr(args, "enable_prefix_caching", False),
        async_scheduling=False if getattr(args, "no_async_scheduling", False) else None,
        linear_state_dtype=getattr(args, "linear_state_dtype", "float32"),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        deterministic=getattr(args, "deterministic", False),
    )
    freeze_startup_objects()  # as `kvloom serve` does: the run is this engine's
    return engine


def latency(model: str, args) -> dict:
    if getattr(args, "executor", "inprocess") != "inprocess":
        raise ValueError("--executor: latency runs in-process (it reads the weights' bytes)")
    engine = make_engine(model, args)
    device = engine.executor.worker.device
    rng = random.Random(0)
    # Ids as the peer kit draws them, inside any vocabulary (the demo model has 512 ids).
    prompt = [rng.randrange(10, min(1000, engine.vocab_size)) for _ in range(128)]
    params = SamplingParams(
        max_tokens=args.steps + 1, temperature=0.0, ignore_eos=True, detokenize=False
    )
    engine.add_request("warmup", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("r", {"prompt_token_ids": prompt}, params)
    engine.step()  # prefill + first token
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    step_s = elapsed / steps
    bytes_per_step = weight_bytes(engine)
    bandwidth = copy_bandwidth(device)
    return {
        "ms_per_token": round(step_s * 1e3, 3),
        "tokens_per_s": round(1 / step_s, 1),
        "weight_bytes_per_step": bytes_per_step,
        "achieved_GBps": round(bytes_per_step / step_s / 1e9, 1),
        "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
        "floor_ms_per_token": round(bytes_per_step / bandwidth * 1e3, 3),
        "fraction_of_floor": round((bytes_per_step / bandwidth) / step_s, 3),
    }


def offline_workload(args, vocab_size: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) per request, drawn exactly as the vLLM peer kit draws
    them (numpy default_rng(seed 0): prompt lengths, output lengths, then the ids), so both
    engines run the same 1000 requests."""
    import numpy as np

    rng = np.random.default_rng(0)
    lo, hi = args.prompt_len
    prompt_lens = rng.integers(lo, hi + 1, args.num_requests)
    output_lens = rng.integers(args.output_len[0], args.output_len[1] + 1, args.num_requests)
    prompts = [rng.integers(0, vocab_size, int(n)).tolist() for n in prompt_lens]
    return list(zip(prompts, (int(n) for n in output_lens)))


def workload_params(max_tokens: int) -> SamplingParams:
    """A workload request's sampling: greedy, exactly `max_tokens` (ignore_eos), token ids
    only, one output at the end."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        output_kind="final_only",
    )


def run_offline(engine: Engine, requests: list[tuple[list[int], int]]) -> tuple[float, int]:
    """Adds every (prompt ids, output length) request at once and steps until all finish:
    (seconds, output tokens)."""
    for i, (prompt, out_len) in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, workload_params(out_len))
    start = time.perf_counter()
    out_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                out_tokens += len(out.outputs[0].token_ids)
    return time.perf_counter() - start, out_tokens


def throughput(model: str, args) -> dict:
    """The offline workload, `repeat` times on one engine: figures of the first run (as the
    peer kit times vLLM's one run), and every run's seconds."""
    engine = make_engine(model, args)
    requests = offline_workload(args, engine.vocab_size)
    runs = []
    try:
        for _ in range(getattr(args, "repeat", 1)):
            runs.append(run_offline(engine, requests))
    finally:
        engine.shutdown()  # a Ray executor's actors and placement group
    elapsed, out_tokens = runs[0]
    prompt_tokens = sum(len(p) for p, _ in requests)
    result = {
        "executor": getattr(args, "executor", "inprocess"),
        "requests": args.num_requests,
        "seconds": round(elapsed, 2),
        "output_tokens_per_s": round(out_tokens / elapsed, 1),
        "total_tokens_per_s": round((out_tokens + prompt_tokens) / elapsed, 1),
    }
    if len(runs) > 1:
        result["seconds_per_run"] = [round(seconds, 2) for seconds, _ in runs]
    return result


def percentiles(values: list[float], name: str) -> dict:
    """{name_p50, name_p90, name_p99, name_mean} in milliseconds (nearest-rank)."""
    if not values:
        return {}
    ordered = sorted(values)
    out = {}
    for q in (50, 90, 99):
        rank = max(1, -(-q * len(ordered) // 100))  # ceil(q% of n), at least the first
        out[f"{name}_p{q}_ms"] = round(ordered[rank - 1] * 1e3, 2)
    out[f"{name}_mean_ms"] = round(statistics.fmean(ordered) * 1e3, 2)
    return out


def load(model: str, args) -> dict:
    """The offline requests arriving at `request_rate` per second (exponential gaps, seed
    0): TTFT and time per output token under that load."""
    if not args.request_rate or args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 for a load run, got {args.request_rate}")
    engine = make_engine(model, args)
    requests = offline_workload(args, engine.vocab_size)
    gaps = random.Random(0)
    offsets, t = [], 0.0
    for _ in requests:
        offsets.append(t)
        t += gaps.expovariate(args.request_rate)
    start = time.monotonic()
    ttft, tpot, out_tokens, next_up = [], [], 0, 0
    while next_up < len(requests) or engine.has_unfinished_requests():
        now = time.monotonic()
        while next_up < len(requests) and start + offsets[next_up] <= now:
            prompt, out_len = requests[next_up]
            engine.add_request(
                str(next_up),
                {"prompt_token_ids": prompt},
                workload_params(out_len),
                arrival_time=start + offsets[next_up],
            )
            next_up += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + offsets[next_up] - time.monotonic()))
            continue
        for out in engine.step():
            if out.finished:
                out_tokens += len(out.outputs[0].token_ids)
                ttft.append(out.metrics["ttft_s"])
                if "tpot_s" in out.metrics:
                    tpot.append(out.metrics["tpot_s"])
    elapsed = time.monotonic() - start
    engine.shutdown()
    return {
        "executor": getattr(args, "executor", "inprocess"),
        "requests": len(requests),
        "request_rate": args.request_rate,
        "seconds": round(elapsed, 2),
        "output_tokens_per_s": round(out_tokens / elapsed, 1),
        **percentiles(ttft, "ttft"),
        **percentiles(tpot, "tpot"),
    }


def run(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        quantization = getattr(args, "quantization", None)
        model = args.model or str(shape_dir(args.shape, Path(tmp), quantization))
        fn = {"latency": latency, "throughput": throughput, "load": load}[args.kind]
        result = fn(model, args)
    result.update(
        kind=args.kind,
        model=args.model or args.shape,
        dtype=args.dtype,
        linear_state_dtype=getattr(args, "linear_state_dtype", "float32"),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        quantization=getattr(args, "quantization", None) or "none",
        device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    )
    return result
