"""Host time of one engine step at N running decodes, with the model's forward stubbed out.

What is left when the GPU costs nothing: scheduling, block allocation, batch building,
sampling bookkeeping, detokenization and output assembly, per step, on this machine's
CPU. A tiny llama demo model runs in process on the CPU; its forward is replaced by
zeros (the LM head and the sampler still run, on the CPU). The collector is frozen after
start-up, as `kvloom serve` does. Prints one JSON line; `--profile` adds the functions
with the most own time (cProfile).

    python benchmarks/host_step_cost.py --rows 256 [--steps 30] [--profile] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvloom import Engine, SamplingParams
from kvloom.cluster.demo_model import write_demo_model
from kvloom.contracts.gc_freeze import freeze_startup_objects


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--sort", default="tottime", help="cProfile order: tottime|cumulative")
    parser.add_argument("--top", type=int, default=20, help="functions listed with --profile")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_demo_model(Path(tmp) / "m", arch="llama")
        engine = Engine(
            model=str(path),
            dtype="float32",
            device="cpu",
            progress=False,
            max_num_seqs=args.rows,
            max_num_batched_tokens=8192,
            max_model_len=1024,
            num_kv_blocks=args.rows * 40,
        )
        runner = engine.executor.worker.runner
        hidden = runner.model.config["hidden_size"]
        runner._forward = lambda input_ids, batch: torch.zeros(input_ids.shape[0], hidden)
        params = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
        for i in range(args.rows):
            prompt = [5 + (i * 7 + j) % 400 for j in range(32)]
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        for _ in range(5):  # prefill, then decode steps only
            engine.step()
        freeze_startup_objects()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        ms = (time.perf_counter() - start) * 1e3 / args.steps
        row = {
            "rows": args.rows,
            "host_ms_per_step": round(ms, 3),
            "machine": f"{platform.machine()} CPU, torch {torch.__version__}",
        }
        print(json.dumps(row), flush=True)
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.steps):
                engine.step()
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats(args.sort).print_stats(args.top)
            print(text.getvalue())
    if args.out is not None:
        args.out.write_text(json.dumps(row, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
