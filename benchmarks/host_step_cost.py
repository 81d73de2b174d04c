"""Host time of one engine step at N running decodes, with the model's forward stubbed out.

What is left when the GPU costs nothing: scheduling, block allocation, batch building,
sampling bookkeeping, detokenization and output assembly, per step, on this machine's
CPU. A tiny llama demo model runs in process on the CPU; its forward is replaced by
zeros (the LM head and the sampler still run, on the CPU). The collector is frozen after
start-up, as `kvloom serve` does. Prints one JSON line; `--profile` adds the functions
with the most own time (cProfile).

    python benchmarks/host_step_cost.py --rows 256 [--steps 30] [--profile] [--out FILE]
    python benchmarks/host_step_cost.py --rows 1000 --offline --steps 400

`--offline` runs `kvloom bench throughput`'s kind of requests instead (prompts of 128-1024
tokens, 64-512 outputs, freeze before they arrive, as `kvloom bench` does) from the first
step, prefills included. The JSON line counts Python's GC collections per generation and
their milliseconds (KVLOOM_GC_YOUNG_THRESHOLD sets the young generation's threshold).
`--phases` adds the host ms per step of the scheduler's and the runner's main calls
(timed around each call, so nothing is inflated as under cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import io
import json
import platform
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvloom import Engine, SamplingParams
from kvloom.cluster.bench import workload_params
from kvloom.cluster.demo_model import write_demo_model
from kvloom.contracts.gc_freeze import freeze_startup_objects


def add_offline_requests(engine: Engine, count: int) -> None:
    rng = random.Random(0)
    for i in range(count):
        prompt = [rng.randrange(10, 500) for _ in range(rng.randint(128, 1024))]
        params = workload_params(rng.randint(64, 512))  # as the bench: one output at the end
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)


class CollectionTimer:
    """Counts and times Python's GC collections per generation (gc.callbacks)."""

    def __init__(self):
        self.counts, self.ms, self._start = [0, 0, 0], [0.0, 0.0, 0.0], 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.ms[info["generation"]] += (time.perf_counter() - self._start) * 1e3

    def stop(self):
        gc.callbacks.remove(self._callback)


PHASES = {
    "schedule": lambda e: (e.core.scheduler, "schedule"),
    "update_from_output": lambda e: (e.core.scheduler, "update_from_output"),
    "input_batch_apply": lambda e: (e.executor.worker.runner.input_batch, "apply"),
    "build_batch": lambda e: (e.executor.worker.runner, "build_batch"),
    "sample": lambda e: (e.executor.worker.runner, "_sample_plain"),
    "output_processor": lambda e: (e.output_processor, "process"),
}


def time_phases(engine: Engine) -> dict[str, float]:
    """Wraps each phase's call to add its seconds to the returned dict."""
    seconds = dict.fromkeys(PHASES, 0.0)

    def timed(name, call):
        @functools.wraps(call)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start

        return wrapper

    for name, where in PHASES.items():
        owner, attr = where(engine)
        setattr(owner, attr, timed(name, getattr(owner, attr)))
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--sort", default="tottime", help="cProfile order: tottime|cumulative")
    parser.add_argument("--top", type=int, default=20, help="functions listed with --profile")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--offline", action="store_true", help="the throughput bench's requests")
    parser.add_argument("--phases", action="store_true", help="host ms per step of each phase")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_demo_model(Path(tmp) / "m", arch="llama")
        engine = Engine(
            model=str(path),
            dtype="float32",
            device="cpu",
            progress=False,
            max_num_seqs=args.rows,
            max_num_batched_tokens=16384 if args.offline else 8192,
            max_model_len=2048 if args.offline else 1024,
            num_kv_blocks=args.rows * (100 if args.offline else 40),
        )
        runner = engine.executor.worker.runner
        hidden = runner.model.config["hidden_size"]
        runner._forward = lambda input_ids, batch: torch.zeros(input_ids.shape[0], hidden)
        if args.offline:
            freeze_startup_objects()  # before the requests, as `kvloom bench` freezes
            add_offline_requests(engine, args.rows)
        else:
            params = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
            for i in range(args.rows):
                prompt = [5 + (i * 7 + j) % 400 for j in range(32)]
                engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
            for _ in range(5):  # prefill, then decode steps only
                engine.step()
            freeze_startup_objects()
        phases = time_phases(engine) if args.phases else None
        collections = CollectionTimer()
        start = time.perf_counter()
        steps = rows = 0
        while steps < args.steps and engine.has_unfinished_requests():
            rows += len(engine.core.scheduler.running)
            engine.step()
            steps += 1
        ms = (time.perf_counter() - start) * 1e3 / steps
        collections.stop()
        row = {
            "rows": args.rows,
            "host_ms_per_step": round(ms, 3),
            "steps": steps,
            "mean_running": round(rows / steps, 1),
            "gc_threshold": gc.get_threshold(),
            "gc_collections_per_generation": collections.counts,
            "gc_ms_per_generation": [round(v, 1) for v in collections.ms],
            "machine": f"{platform.machine()} CPU, torch {torch.__version__}",
        }
        if phases is not None:
            row["phase_ms_per_step"] = {k: round(v * 1e3 / steps, 3) for k, v in phases.items()}
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
