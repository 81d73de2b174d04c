"""Where a speculative step's time goes on the GPU (issue 21), in one device call.

Builds the engine on a `kvloom bench` shape (dummy weights) with a speculative config,
decodes `--rows` requests and, over a window of steps: (1) times the step's phases with a
device synchronisation around each (the target's forward, sampling + verification, the
drafter's catch-up and its proposal positions, batch building, scheduling), (2) counts
which forwards replayed a CUDA graph, and (3) lists the GPU kernels by time and the host
functions by own time (cProfile).

    python benchmarks/spec_step_profile.py --shape qwen3-8b --proposer draft_1layer \
        --rows 1 --out $OUT/spec_step.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kvloom import Engine, SamplingParams
from kvloom.cluster.bench import SHAPES, shape_dir

sys.path.insert(0, str(Path(__file__).parent))
from spec_decode import workload  # noqa: E402
from throughput_profile import kernel_summary  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class SyncTimer:
    """Wall time per phase, the device synchronised before and after each call so a phase
    is charged its own GPU work (the sum is a serialised step, slower than the real one)."""

    def __init__(self):
        self.totals = defaultdict(float)
        self.calls = defaultdict(int)

    def wrap(self, obj, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            sync()
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                sync()
                self.totals[label] += time.perf_counter() - start
                self.calls[label] += 1

        setattr(obj, name, timed)


def ms_per_step(engine, steps: int) -> float:
    """Wall ms per engine step over `steps` steps, the device drained at both ends."""
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    return round((time.perf_counter() - start) * 1e3 / steps, 3)


def speculative_config(proposer: str, model: str, tmp: Path, shape: str, k: int):
    if proposer == "none":
        return None
    if proposer == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k}
    if proposer == "self_draft":
        return {"method": "draft_model", "model": model, "num_speculative_tokens": k}
    one_layer = tmp / "one_layer"
    one_layer.mkdir(exist_ok=True)
    (one_layer / "config.json").write_text(json.dumps(dict(SHAPES[shape], num_hidden_layers=1)))
    return {"method": "draft_model", "model": str(one_layer), "num_speculative_tokens": k}


def replay_counts(runner) -> dict[str, int]:
    counts = {}
    for name, graphs in (
        ("decode", runner.graphs),
        ("verify", runner.verify_graphs),
        ("proposal", getattr(runner.draft, "graphs", None)),
    ):
        counts[name] = graphs.replays if graphs is not None else -1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument(
        "--proposer",
        default="draft_1layer",
        choices=["none", "ngram", "self_draft", "draft_1layer"],
    )
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(shape_dir(args.shape, Path(tmp)))
        spec = speculative_config(args.proposer, model, Path(tmp), args.shape, args.k)
        engine = Engine(
            model=model,
            dtype="bfloat16",
            load_format="dummy",
            progress=False,
            speculative_config=spec,
            max_model_len=1024,
            max_num_seqs=max(args.rows, 8),
        )
        runner = engine.executor.worker.runner
        info = {
            "async_scheduling": bool(getattr(engine, "async_scheduling", None)),
            "graph_blockers": runner.graph_blockers(),
            "verify_graph_blockers": runner.verify_graph_blockers() if spec else [],
            "drafter_graph_blockers": runner.drafter_graph_blockers() if spec else [],
        }
        print("INFO", json.dumps(info))
        params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(workload(args.rows, seed=args.rows)):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        for _ in range(8):  # prefill and settle
            engine.step()
        result = {"args": vars(args) | {"out": None}, "info": info}

        # (1) the real step time, then (3) GPU kernels and host functions over a window.
        before = replay_counts(runner)
        result["step_ms"] = ms_per_step(engine, args.steps)
        after = replay_counts(runner)
        result["replays_per_step"] = {
            k: round((after[k] - before[k]) / args.steps, 2) for k in after if after[k] >= 0
        }
        acts = [ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]
        with profile(activities=acts) as prof:
            for _ in range(args.steps):
                engine.step()
        result["kernels"] = kernel_summary(prof, args.steps, top=30)
        host = cProfile.Profile()
        host.enable()
        for _ in range(args.steps):
            engine.step()
        host.disable()
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(30)
        result["host_top"] = text.getvalue()[-7000:]

        # (2) phases, serialised: each charged its own device time.
        timer = SyncTimer()
        targets = [
            (runner, "_forward", "target_forward"),
            (runner, "sample_tokens", "sample_and_verify"),
            (runner, "_sample_plain", "sample_plain"),
            (runner, "build_batch", "build_batch"),
            (runner, "copy_state_pages", "state_page_copies"),
            (engine.scheduler, "schedule", "schedule"),
            (engine.scheduler, "update_from_output", "update_from_output"),
        ]
        draft = runner.draft
        if draft is not None:
            targets.append((draft, "run", "draft_total"))
            for name in ("catch_up", "propose"):
                if hasattr(draft, name):
                    targets.append((draft, name, f"draft_{name}"))
            if getattr(draft, "catch_up_graphs", None) is not None:
                targets.append((draft.catch_up_graphs, "replay", "draft_catch_up_graph"))
        for obj, name, label in targets:
            timer.wrap(obj, name, label)
        result["serialised_step_ms"] = ms_per_step(engine, args.steps)
        result["phase_ms_per_step"] = {
            k: round(v * 1e3 / args.steps, 3) for k, v in sorted(timer.totals.items())
        }
        result["phase_calls_per_step"] = {
            k: round(v / args.steps, 2) for k, v in sorted(timer.calls.items())
        }
        stats = engine.stats()
        result["acceptance_rate"] = stats.get("spec_acceptance_rate")
        result["mean_tokens_per_step"] = stats.get("spec_mean_accepted_length")
    for key in (
        "step_ms",
        "serialised_step_ms",
        "replays_per_step",
        "phase_ms_per_step",
        "phase_calls_per_step",
        "acceptance_rate",
        "mean_tokens_per_step",
    ):
        print(f"RESULT {key} {json.dumps(result[key])}")
    print(f"RESULT gpu_busy_ms_per_step {result['kernels']['gpu_busy_ms_per_step']:.3f}")
    for kernel, ms in list(result["kernels"]["kernels_ms_per_step"].items())[:20]:
        print(f"   {ms:8.3f}  {kernel}")
    print(result["host_top"][:4000])
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
