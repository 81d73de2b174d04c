"""`kvloom bench latency|throughput|load`: see kvloom/cluster/bench.py for the workloads."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="decode latency, offline throughput, latency under load"
    )
    parser.add_argument("kind", choices=("latency", "throughput", "load"))
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="checkpoint dir (default: a --shape with dummy weights)")
    source.add_argument(
        "--shape",
        default="tiny",
        help="tiny, qwen3-8b, qwen3-32b, qwen3-next-24l, qwen3-next-16l or kimi-linear-16l",
    )
    parser.add_argument("--load-format", default=None, choices=("safetensors", "dummy"))
    parser.add_argument(
        "--steps", type=int, default=511, help="latency: decode steps timed (the peer kit's 511)"
    )
    parser.add_argument(
        "--context-len",
        type=int,
        default=128,
        help="latency: prompt tokens before the timed decode (long-context decode: 32768 "
        "and up, with --max-model-len at least this + --steps + 1; a --shape's rope is "
        "stretched past its own limit)",
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="load: requests per second (Poisson arrivals); use with --num-requests",
    )
    add_workload_args(parser)
    parser.add_argument(
        "--quantization",
        default=None,
        choices=("fp8", "w4a16", "awq"),
        help="with --shape: dummy weights in this checkpoint format (fp8: 128x128 "
        "block-scaled e4m3 as Qwen3-8B-FP8; w4a16: compressed-tensors int4, group 128; "
        "awq: int4 with zero points, group 128)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="throughput: run the workload this many times on one engine and report each "
        "run (the first pays the Triton kernels' first compiles; `seconds` is the first run's)",
    )
    parser.add_argument("--out", type=Path, help="write the result as JSON")
    parser.set_defaults(func=run)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload and engine limits shared by `kvloom bench` and the profiling scripts
    in benchmarks/ (so a profile runs exactly what the bench runs)."""
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(128, 1024))
    parser.add_argument("--output-len", type=int, nargs=2, default=(64, 512))
    parser.add_argument("--max-model-len", type=int, default=4096)
    # vLLM's defaults for its offline LLM class on a GPU of >= 70 GiB (H100/H200), so both
    # engines run the workload under the same limits.
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument(
        "--max-cuda-graph-batch-size",
        type=int,
        default=1024,
        help="largest decode graph (vLLM captures up to 512 and runs larger batches eagerly; "
        "kvloom's eager step costs more host time, so the bench captures every batch size)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="off by default, as in the peer kit (random prompts share no prefix)",
    )
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--linear-state-dtype",
        default="float32",
        choices=("float32", "auto", "bfloat16", "float16"),
        help="recurrent state of hybrid models (vLLM keeps it in the model dtype: auto)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "fp8", "fp8_e4m3"),
        help="attention KV pages: auto (the model dtype) or fp8 (float8_e4m3fn)",
    )
    parser.add_argument(
        "--no-async-scheduling", action="store_true", help="one step at a time (comparisons)"
    )
    parser.add_argument(
        "--executor",
        default=None,
        choices=("inprocess", "ray"),
        help="ray runs the workers as Ray actors behind the step channel (the path `kvloom "
        "serve` deploys); default: in-process for one rank, ray for --tp x --dcp > 1",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks (must divide the attention heads)",
    )
    parser.add_argument(
        "--decode-context-parallel-size",
        "--dcp",
        type=int,
        default=1,
        help="decode-context-parallel ranks: the KV cache sharded by token across them",
    )


def run(args: argparse.Namespace) -> int:
    from kvloom.cluster.bench import run as bench

    if args.quantization and args.model:
        raise SystemExit(
            "kvloom bench: --quantization applies to --shape (a --model dir has its own "
            "quantization_config)"
        )
    if args.repeat < 1:
        raise SystemExit(f"kvloom bench: --repeat must be >= 1, got {args.repeat}")
    if args.repeat > 1 and args.kind != "throughput":
        raise SystemExit("kvloom bench: --repeat applies to throughput")
    tp, dcp = args.tensor_parallel_size, args.decode_context_parallel_size
    if tp < 1 or dcp < 1:
        raise SystemExit(f"kvloom bench: --tp and --dcp must be >= 1, got {tp} and {dcp}")
    if tp * dcp > 1 and args.executor == "inprocess":
        raise SystemExit(
            f"kvloom bench: --tp {tp} x --dcp {dcp} needs the Ray executor (--executor ray, "
            "or leave --executor out)"
        )
    if args.kind == "latency":
        check_context(args)
    if args.load_format is None:
        args.load_format = "safetensors" if args.model else "dummy"
    result = bench(args)
    for key, value in result.items():
        print(f"RESULT {key} {value}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


def check_context(args: argparse.Namespace) -> None:
    """The latency run's prompt and its decode must fit the engine's max_model_len."""
    if args.context_len < 1 or args.steps < 1:
        raise SystemExit(
            f"kvloom bench: --context-len and --steps must be >= 1, got "
            f"{args.context_len} and {args.steps}"
        )
    needed = args.context_len + args.steps + 1
    if needed > args.max_model_len:
        raise SystemExit(
            f"kvloom bench: --context-len {args.context_len} + --steps {args.steps} + 1 "
            f"needs --max-model-len >= {needed} (it is {args.max_model_len})"
        )
