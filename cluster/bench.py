"""`kvloom bench`: decode latency against the memory-bandwidth floor, and offline throughput.

Model shapes of real models run with seeded random weights (`load_format="dummy"`), so a
benchmark needs only a config. Workloads follow the GPU issue's definitions:
- latency: one request, a 128-token prompt (`--context-len` for long-context decode), N
  decode steps; ms per token, tokens/s, achieved GB/s = bytes of weights one device reads
  per step (its shard at TP > 1; embedding table excluded) / step time, and its ratio to
  that device's copy bandwidth measured in the same run;
- throughput: 1000 requests, prompts U[128, 1024], outputs U[64, 512], seed 0, ignore_eos;
- load: the same requests arriving as a Poisson process at `--request-rate` per second;
  time to first token (from each request's arrival) and time per output token after the
  first (its mean inter-token latency), as percentiles over the requests.

Every kind runs at any tensor-parallel × decode-context-parallel grid (`--tp`, `--dcp`);
a grid of more than one rank runs on the Ray executor, and every figure is measured through
the engine's step loop, so it holds for both executors.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvloom.cluster.engine import Engine
from kvloom.cluster.offline_floor import floor_model, offline_floor
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
    # Qwen/Qwen3-32B's config.json (transformers 4.51 spelling: rope_theta 1e6, no rope
    # scaling, untied embeddings; native context 32,768, YaRN x4 to 131,072 per its card).
    "qwen3-32b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
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

# Qwen3-Next at 16 layers (4 x (3 Gated DeltaNet : 1 attention)): about 50 GiB of bf16
# weights, so it fits an 80 GB H100 with a KV cache beside vLLM (the 24-layer shape's
# 74.8 GiB does not: both engines ran out of memory on an H100, 2026-12-06). Per-layer
# costs as the 24-layer shape's, for same-lease comparisons when no H200 is lent.
SHAPES["qwen3-next-16l"] = {
    **SHAPES["qwen3-next-24l"],
    "num_hidden_layers": 16,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 4,
}


# The `quantization_config` a shape gets with `--quantization`, as the published
# checkpoints write it: Qwen3-8B-FP8's block-scaled FP8 (its lm_head stays bf16),
# llm-compressor's W4A16 (int4, group 128, symmetric) on every Linear but lm_head, and
# AWQ (the same with zero points, as per-group offsets).
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
    # AutoAWQ's GEMM layout (int4, group 128, zero points).
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True},
}


def shape_dir(
    shape: str, root: Path, quantization: str | None = None, context_len: int | None = None
) -> Path:
    """A checkpoint dir with only config.json and the demo tokenizer (weights are dummy);
    `quantization` (fp8, w4a16, awq) adds that format's `quantization_config`; a `context_len`
    past the shape's own limit stretches its rope (`extend_context`)."""
    from kvloom.cluster.demo_model import write_demo_model

    config = shape_config(shape)
    if context_len:
        config = extend_context(config, context_len)
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


def shape_config(shape: str) -> dict:
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    return dict(SHAPES[shape])


def extend_context(config: dict, context_len: int) -> dict:
    """The config with room for `context_len` positions. Qwen3 reaches 131,072 with YaRN
    x4, which kvloom's rotary table lacks; linear scaling by the same whole factor stands in
    (dummy weights: the attention and KV-cache cost of each position is the same)."""
    native = config.get("max_position_embeddings")
    if native is None or context_len <= native:
        return config
    params = dict(config.get("rope_parameters") or {})
    if params.get("rope_type", "default") != "default":
        raise ValueError(
            f"--max-model-len {context_len} exceeds the shape's {native} positions and its "
            f"rope ({params['rope_type']}) cannot be stretched"
        )
    factor = math.ceil(context_len / native)
    params.update(
        rope_type="linear",
        factor=float(factor),
        rope_theta=params.get("rope_theta", config.get("rope_theta", 10000.0)),
    )
    return dict(config, rope_parameters=params, max_position_embeddings=native * factor)


def check_grid(config: dict, tp: int, dcp: int) -> None:
    """Refuses a grid the model cannot be split over, before any worker starts (the
    workers would say the same, after Ray and the weights)."""
    if tp < 1 or dcp < 1:
        raise ValueError(f"--tp and --dcp must be >= 1, got tp={tp}, dcp={dcp}")
    heads = config.get("num_attention_heads")
    if heads and heads % tp:
        raise ValueError(f"--tp {tp} must divide num_attention_heads ({heads})")
    kv_heads = config.get("num_key_value_heads")
    if kv_heads and kv_heads >= tp and kv_heads % tp:
        raise ValueError(f"--tp {tp} must divide num_key_value_heads ({kv_heads})")


def grid(args) -> tuple[int, int]:
    """(tensor-parallel size, decode-context-parallel size) of a bench run."""
    return getattr(args, "tensor_parallel_size", 1), getattr(
        args, "decode_context_parallel_size", 1
    )


def executor_name(args) -> str:
    """The executor a run uses: as asked, else Ray for a grid of more than one rank."""
    tp, dcp = grid(args)
    return getattr(args, "executor", None) or ("ray" if tp * dcp > 1 else "inprocess")


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


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """Dense matmul rate in FLOP/s at a large square size (8192 on a GPU), median of 5."""
    n = 8192 if device.type == "cuda" else 256
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    times = []
    for _ in range(6):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / sorted(times[1:])[2]


def on_rank0(engine: Engine, fn):
    """`fn(worker)` on rank 0's worker: in this process, or inside its Ray actor (a control
    call, once per run, never per step)."""
    executor = engine.executor
    if hasattr(executor, "worker"):
        return fn(executor.worker)
    import ray

    return ray.get(executor.actors[0].__ray_call__.remote(lambda actor: fn(actor.worker)))


def rank_weight_bytes(worker) -> int:
    return decode_weight_bytes(worker.runner.model)


def rank_copy_bandwidth(worker) -> float:
    return copy_bandwidth(worker.device)


def rank_floor_inputs(worker, kv_cache_dtype: str) -> tuple:
    """(FloorModel or the reason there is none, matmul FLOP/s, copy bytes/s) of rank 0."""
    model = worker.runner.model
    found = floor_model(model, kv_cache_dtype)
    if isinstance(found, str):
        return found, None, None
    dtype = next(model.parameters()).dtype
    return found, matmul_rate(worker.device, dtype), copy_bandwidth(worker.device)


def throughput_floor(engine: Engine, args, requests) -> dict:
    """The workload's floor (cluster/offline_floor.py), or the reason it has none."""
    if getattr(args, "quantization", None):
        return {"floor_reason": "quantized weights"}
    if grid(args)[1] > 1:
        return {"floor_reason": "DCP shards the KV cache"}
    kv_cache_dtype = getattr(args, "kv_cache_dtype", "auto")
    found, flops, bandwidth = on_rank0(
        engine, lambda worker: rank_floor_inputs(worker, kv_cache_dtype)
    )
    if isinstance(found, str):
        return {"floor_reason": found}
    lengths = [(len(prompt), out_len) for prompt, out_len in requests]
    return offline_floor(found, lengths, flops, bandwidth)


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
        executor=executor_name(args),
        tensor_parallel_size=grid(args)[0],
        decode_context_parallel_size=grid(args)[1],
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


def generated(outputs) -> int:
    """Tokens the one request has so far (0 before its first step output)."""
    return max((len(out.outputs[0].token_ids) for out in outputs), default=0)


def timed_decode(engine: Engine, prompt: list[int], steps: int) -> tuple[float, int]:
    """Prefills `prompt` (every chunk), then times the decode to `steps` more tokens through
    the public step loop: (seconds, tokens decoded in them). Tokens are counted, not
    steps: with async scheduling a step call need not yield a token."""
    params = SamplingParams(
        max_tokens=steps + 1, temperature=0.0, ignore_eos=True, detokenize=False
    )
    engine.add_request("r", {"prompt_token_ids": prompt}, params)
    first = 0
    while first == 0 and engine.has_unfinished_requests():
        first = generated(engine.step())
    start = time.perf_counter()
    last = first
    while engine.has_unfinished_requests():
        last = max(last, generated(engine.step()))
    return time.perf_counter() - start, last - first


def latency(model: str, args) -> dict:
    """Batch-1 decode after a `context_len`-token prompt, at any TP × DCP grid. The step
    loop is the engine's own; the weight bytes and copy bandwidth are rank 0's (a shard at
    TP > 1: every rank reads its own at once, so one device's floor is the grid's)."""
    engine = make_engine(model, args)
    try:
        rng = random.Random(0)
        # Ids as the peer kit draws them, inside any vocabulary (the demo model has 512 ids).
        context = getattr(args, "context_len", 128)
        prompt = [rng.randrange(10, min(1000, engine.vocab_size)) for _ in range(context)]
        engine.add_request(
            "warmup", {"prompt_token_ids": prompt[:128]}, SamplingParams(max_tokens=4)
        )
        while engine.has_unfinished_requests():
            engine.step()
        elapsed, tokens = timed_decode(engine, prompt, args.steps)
        bytes_per_step = on_rank0(engine, rank_weight_bytes)
        bandwidth = on_rank0(engine, rank_copy_bandwidth)
    finally:
        engine.shutdown()  # a Ray executor's actors and placement group
    step_s = elapsed / tokens
    return {
        "executor": executor_name(args),
        "context_len": context,
        "decode_tokens": tokens,
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


def schedule_figures(before: dict, after: dict) -> dict:
    """How the first run was scheduled: engine steps, preemptions, and the block pool it
    had (steps set the offline time where each step reads every weight, as a mixture of
    experts does at large batches: compare the steps with the peer's concurrency)."""
    return {
        "steps": after["num_steps"] - before["num_steps"],
        "preemptions": after["num_preemptions"] - before["num_preemptions"],
        "kv_pool_blocks": after["num_blocks"],
        "block_size": after["block_size"],
    }


def throughput(model: str, args) -> dict:
    """The offline workload, `repeat` times on one engine: figures of the first run (as the
    peer kit times vLLM's one run), and every run's seconds."""
    engine = make_engine(model, args)
    requests = offline_workload(args, engine.vocab_size)
    runs = []
    try:
        before = engine.stats()
        for _ in range(getattr(args, "repeat", 1)):
            runs.append(run_offline(engine, requests))
            if len(runs) == 1:
                schedule = schedule_figures(before, engine.stats())
        floor = throughput_floor(engine, args, requests)
    finally:
        engine.shutdown()  # a Ray executor's actors and placement group
    elapsed, out_tokens = runs[0]
    prompt_tokens = sum(len(p) for p, _ in requests)
    result = {
        "executor": executor_name(args),
        "requests": args.num_requests,
        "seconds": round(elapsed, 2),
        "output_tokens_per_s": round(out_tokens / elapsed, 1),
        "total_tokens_per_s": round((out_tokens + prompt_tokens) / elapsed, 1),
        **schedule,
        "tokens_per_step": round((out_tokens + prompt_tokens) / max(schedule["steps"], 1), 1),
    }
    if len(runs) > 1:
        result["seconds_per_run"] = [round(seconds, 2) for seconds, _ in runs]
    if "floor_seconds" in floor:
        floor["fraction_of_floor"] = round(floor["floor_seconds"] / elapsed, 3)
    return {**result, **floor}


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
        "executor": executor_name(args),
        "requests": len(requests),
        "request_rate": args.request_rate,
        "seconds": round(elapsed, 2),
        "output_tokens_per_s": round(out_tokens / elapsed, 1),
        **percentiles(ttft, "ttft"),
        **percentiles(tpot, "tpot"),
    }


def run(args) -> dict:
    tp, dcp = grid(args)
    config = (
        json.loads((Path(args.model) / "config.json").read_text())
        if args.model
        else shape_config(args.shape)
    )
    check_grid(config.get("text_config") or config, tp, dcp)
    with tempfile.TemporaryDirectory() as tmp:
        quantization = getattr(args, "quantization", None)
        model = args.model or str(
            shape_dir(args.shape, Path(tmp), quantization, args.max_model_len)
        )
        fn = {"latency": latency, "throughput": throughput, "load": load}[args.kind]
        result = fn(model, args)
    result.update(
        tp=tp,
        dcp=dcp,
        kind=args.kind,
        model=args.model or args.shape,
        dtype=args.dtype,
        linear_state_dtype=getattr(args, "linear_state_dtype", "float32"),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        quantization=getattr(args, "quantization", None) or "none",
        device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    )
    return result
