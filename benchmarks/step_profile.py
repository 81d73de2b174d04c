"""Where a decode step's time goes: GPU time of the captured graph versus the whole step.

Builds the engine on a `kvloom bench` shape (dummy weights), starts `--batch` requests,
then (1) times graph replays alone with CUDA events, (2) times whole engine steps, and
(3) profiles the host side of those steps with cProfile (top functions by own time).

    python benchmarks/step_profile.py --shape qwen3-8b --batch 1 --out $OUT/profile.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import tempfile
import time
from pathlib import Path

import torch

from kvloom import Engine, SamplingParams
from kvloom.cluster.bench import shape_dir


def report_syncs(engine, steps: int = 3) -> None:
    """Prints where the host waits for the device during a few engine steps (torch's sync
    debug mode), with the kvloom frames of each call site."""
    import traceback
    import warnings

    seen = set()

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [
            f for f in traceback.extract_stack() if "kvloom" in f.filename or "/work" in f.filename
        ]
        key = tuple((f.filename, f.lineno) for f in frames[-4:])
        if key not in seen:
            seen.add(key)
            print(
                "SYNC",
                message,
                " <- ".join(
                    f"{f.filename.split('/')[-1]}:{f.lineno}" for f in reversed(frames[-5:])
                ),
            )

    old = warnings.showwarning
    warnings.showwarning = show
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for _ in range(steps):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(shape_dir(args.shape, Path(tmp)))
        engine = Engine(
            model=model,
            dtype="bfloat16",
            load_format="dummy",
            progress=False,
            max_model_len=4096,
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            executor="inprocess",
        )
        runner = engine.executor.worker.runner
        for batch in args.batch:
            params = SamplingParams(
                max_tokens=3 * args.steps + 10, temperature=0.0, ignore_eos=True, detokenize=False
            )
            for i in range(batch):
                prompt = [10 + (i * 31 + j) % 900 for j in range(128)]
                engine.add_request(f"b{batch}-{i}", {"prompt_token_ids": prompt}, params)
            for _ in range(3):
                engine.step()
            report_syncs(engine)
            size = next(s for s in runner.graphs.sizes if s >= batch)
            graph = runner.graphs.graphs[size]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(args.steps):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            replay_ms = start.elapsed_time(end) / args.steps
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            step_ms = (time.perf_counter() - t0) * 1e3 / args.steps
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.steps):
                engine.step()
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
            results[f"batch{batch}"] = {
                "graph_replay_ms": round(replay_ms, 3),
                "engine_step_ms": round(step_ms, 3),
                "host_profile_top": text.getvalue()[-6000:],
            }
            print(f"RESULT batch{batch}_graph_replay_ms {replay_ms:.3f}")
            print(f"RESULT batch{batch}_engine_step_ms {step_ms:.3f}")
            print(text.getvalue()[:3500])
            for i in range(batch):
                engine.abort_request(f"b{batch}-{i}")
            while engine.has_unfinished_requests():
                engine.step()
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
