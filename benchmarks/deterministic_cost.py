"""Throughput cost of `deterministic=True` (batch-invariant kernels), one GPU.

For each model shape (random dummy weights, bfloat16, CUDA graphs on), runs the same
offline workload with the mode off and on, one engine after the other in this process, and
prints one JSON line per shape plus a summary line:

    {"shape": "qwen3-8b", "off_tok_s": ..., "on_tok_s": ..., "cost": 0.12, ...}

cost = 1 - on / off (output tokens per second) of each mode's last run; the goal (issue 23)
is cost <= 0.15. Each engine runs the workload `--repeat` times (default 2) and the last run
is timed: a mode's first run in a fresh process pays its Triton compiles (the batch-invariant
kernels are other kernels), which inflated a 2026-12-05 figure. Usage (about 3-4 minutes on
an H200 with the defaults):

    python benchmarks/deterministic_cost.py [--shapes qwen3-8b qwen3-next-24l]
        [--num-requests 256] [--prompt-len 128 512] [--output-len 64 128] [--repeat 2]
        [--plan-tables FILE ...] [--out FILE]

`--plan-tables` adds one "on" run per table file (benchmarks/batch_invariant_plans.py
--tables writes one: the matmul's Hopper tiles), each reported as a variant beside the
default table's.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path

import torch

from kvloom import Engine
from kvloom.cluster.bench import offline_workload, run_offline, shape_dir
from kvloom.kernels import batch_invariant_triton
from kvloom.kernels.dispatch import set_batch_invariant


def run_once(model: str, args, deterministic: bool) -> dict:
    engine = Engine(
        model=model,
        dtype="bfloat16",
        load_format="dummy",
        progress=False,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
        deterministic=deterministic,
    )
    requests = offline_workload(args, engine.vocab_size)
    runs = [run_offline(engine, requests) for _ in range(max(1, args.repeat))]
    elapsed, out_tokens = runs[-1]
    engine.shutdown()
    del engine
    gc.collect()  # the runner's graphs and pools sit in cycles: free them before the next
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    set_batch_invariant(False)
    return {
        "seconds": round(elapsed, 2),
        "tok_s": round(out_tokens / elapsed, 1),
        "seconds_per_run": [round(seconds, 2) for seconds, _ in runs],
    }


def _variant_run(model: str, args, table_path: Path, off_tok_s: float) -> dict:
    """The mode on with the matmul table in `table_path`, then the default table back."""
    table = json.loads(table_path.read_text())
    default = batch_invariant_triton.matmul_table()
    batch_invariant_triton.load_matmul_table(table_path)
    try:
        on = run_once(model, args, True)
    finally:
        batch_invariant_triton.set_matmul_table(*default)
    return {
        "table": table_path.name,
        "plans": table["plans"],
        "by_shape": table.get("by_shape", {}),
        "on_tok_s": on["tok_s"],
        "on_seconds_per_run": on["seconds_per_run"],
        "cost": round(1 - on["tok_s"] / off_tok_s, 4),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3-8b", "qwen3-next-24l"])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(128, 512))
    parser.add_argument("--output-len", type=int, nargs=2, default=(64, 128))
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=2, help="runs per engine; the last is timed")
    parser.add_argument("--plan-tables", type=Path, nargs="*", default=[])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            model = str(shape_dir(shape, Path(tmp)))
            off = run_once(model, args, False)
            on = run_once(model, args, True)
            row = {
                "shape": shape,
                "requests": args.num_requests,
                "off_tok_s": off["tok_s"],
                "on_tok_s": on["tok_s"],
                "off_s": off["seconds"],
                "on_s": on["seconds"],
                "off_seconds_per_run": off["seconds_per_run"],
                "on_seconds_per_run": on["seconds_per_run"],
                "cost": round(1 - on["tok_s"] / off["tok_s"], 4),
                "variants": [
                    _variant_run(model, args, table, off["tok_s"]) for table in args.plan_tables
                ],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {"deterministic_cost": {r["shape"]: r["cost"] for r in rows}, "goal": 0.15}
    print(json.dumps(summary), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"rows": rows, **summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
