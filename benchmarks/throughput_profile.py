"""Where the offline-throughput run's time goes (issue 7), in one device call.

Runs `kvloom bench throughput`'s workload on a shape and records, per engine step, the wall
time, rows and tokens scheduled, and whether the step was decode-only. At the chosen step
numbers it profiles a window of steps with `torch.profiler` (CPU + CUDA) and reports the
GPU's busy time against the wall time of the window (host-bound or device-bound) and the
kernels by GPU time. Host phases (schedule, submit, wait for the device, update, outputs)
are timed on every step.

`--compiles` names the Triton compiles inside the timed run (`compile_watch.py`): kernel,
first step, seconds; a mid-run compile is a stall no steady state has.

`--layer-host` times the host per decoder-layer part in eager steps and counts the Triton
launches each makes (`layer_host.py`); `--host-fn MODULE:ATTR` adds a named function as a
part of its own (fla's chunked forward, a layer's glue method).

`--gpu-gaps` measures the host's share without a profiler (which slows the host it
measures): a CUDA event is recorded as each step's forward is enqueued and another after
its sampling is enqueued. Their spans are the device's work per step; the time between one
step's end event and the next step's start event is the device waiting for the host.

    python benchmarks/throughput_profile.py --shape qwen3-8b --num-requests 1000 \
        --max-num-seqs 256 --profile-at --gpu-gaps --out $OUT/gpu_gaps_256.json

    python benchmarks/throughput_profile.py --shape qwen3-8b --max-num-seqs 1024 \
        --max-num-batched-tokens 16384 --profile-at 40 400 --out $OUT/tp_profile.json

On a CPU, `--shape tiny --num-requests 300` shows the host side alone.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

from kvloom.cluster.bench import make_engine, offline_workload, shape_dir, workload_params
from kvloom.cluster.commands.bench import add_workload_args

sys.path.insert(0, str(Path(__file__).parent))
from compile_watch import CompileWatch  # noqa: E402
from layer_host import LayerHost, decoder_layers  # noqa: E402
from step_profile import report_syncs  # noqa: E402


class PhaseTimer:
    """Accumulates wall time per named phase by wrapping bound methods. Phases inside a
    `submit` are labelled with the kind of step submitted (decode-only or mixed)."""

    def __init__(self):
        self.totals = defaultdict(float)
        self.kind = ""

    def wrap(self, obj, name: str, label: str, tagged: bool = False) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                key = f"{self.kind}/{label}" if tagged else label
                self.totals[key] += time.perf_counter() - start

        setattr(obj, name, timed)

    def wrap_submit(self, executor, name: str) -> None:
        inner = getattr(executor, name)

        def tagged_submit(sched):
            decode = all(n == 1 for n in sched.num_scheduled_tokens.values())
            self.kind = "decode" if decode else "mixed"
            return inner(sched)

        setattr(executor, name, tagged_submit)
        self.wrap(executor, name, name, tagged=True)


class GpuGaps:
    """CUDA events around each submitted step: [forward enqueued, sampling enqueued]."""

    def __init__(self, runner):
        self.spans: list[list] = []
        forward, submit = runner._forward, runner.submit

        def recorded_forward(*args, **kwargs):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self.spans.append([start, None])
            return forward(*args, **kwargs)

        def recorded_submit(sched):
            pending = submit(sched)
            if self.spans and self.spans[-1][1] is None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.spans[-1][1] = end
            return pending

        runner._forward, runner.submit = recorded_forward, recorded_submit

    def summary(self, shapes: list, min_rows: int) -> dict:
        """Device busy and waiting ms, for decode-only and mixed steps of at least
        `min_rows` rows (shapes: the scheduled (rows, tokens, decodes) per step)."""
        torch.cuda.synchronize()
        totals = defaultdict(lambda: [0.0, 0.0, 0])
        for i, (start, end) in enumerate(self.spans[:-1]):
            rows, tokens, decodes = shapes[i]
            if end is None or rows < min_rows:
                continue
            kind = "decode" if tokens == decodes else "mixed"
            busy = start.elapsed_time(end)
            idle = max(0.0, end.elapsed_time(self.spans[i + 1][0]))
            totals[kind][0] += busy
            totals[kind][1] += idle
            totals[kind][2] += 1
        out = {}
        for kind, (busy, idle, steps) in totals.items():
            out[kind] = {
                "steps": steps,
                "gpu_busy_ms_per_step": round(busy / steps, 3),
                "gpu_waiting_ms_per_step": round(idle / steps, 3),
                "host_share_percent": round(100 * idle / (busy + idle), 2),
            }
        return out

    def mixed_by_prefill_tokens(self, shapes: list, min_rows: int) -> dict:
        """Mixed steps of at least `min_rows` rows by their prefill tokens (scheduled tokens
        less decodes), each bucket's step count and mean span from the forward's start to
        the step's end. A span counts the device's idle time inside the step too, so an
        eager forward whose host is slower than its kernels shows here, not in the waits."""
        torch.cuda.synchronize()
        buckets = defaultdict(list)
        for i, (start, end) in enumerate(self.spans[:-1]):
            rows, tokens, decodes = shapes[i]
            if end is None or rows < min_rows or tokens == decodes:
                continue
            prefill = tokens - decodes
            bound = next((b for b in PREFILL_BUCKETS if prefill <= b), None)
            buckets[f"<={bound}" if bound else f">{PREFILL_BUCKETS[-1]}"].append(
                (prefill, start.elapsed_time(end))
            )
        return {
            name: {
                "steps": len(rows),
                "mean_prefill_tokens": round(sum(p for p, _ in rows) / len(rows)),
                "mean_span_ms": round(sum(ms for _, ms in rows) / len(rows), 3),
            }
            for name, rows in sorted(buckets.items(), key=lambda item: item[1][0][0])
        }


# Prefill tokens per mixed step: the buckets of GpuGaps.mixed_by_prefill_tokens.
PREFILL_BUCKETS = (128, 512, 1024, 2048, 4096, 8192)
ALLOCATOR_COUNTS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms")


def allocator_counts() -> dict:
    """torch's caching-allocator counters: cudaMalloc / cudaFree calls and retries (a
    retry frees every cached block, a device-wide sync). Zero on a CPU."""
    if not torch.cuda.is_available():
        return dict.fromkeys(ALLOCATOR_COUNTS, 0)
    stats = torch.cuda.memory_stats()
    return {name: int(stats.get(name, 0)) for name in ALLOCATOR_COUNTS}


def kernel_summary(prof, steps: int, top: int) -> dict:
    """GPU kernel time per step, grouped by kernel name, and the busy time in total."""
    per_kernel = defaultdict(float)
    busy = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.device_time_total / 1e3
            busy.append((event.time_range.start, event.time_range.end))
    busy.sort()
    covered, end = 0.0, None
    for lo, hi in busy:  # union of kernel intervals: time the GPU had work
        if end is None or lo > end:
            covered += hi - lo
            end = hi
        elif hi > end:
            covered += hi - end
            end = hi
    kernels = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]
    return {
        "gpu_busy_ms_per_step": covered / 1e3 / steps,
        "kernels_ms_per_step": {name[:90]: round(ms / steps, 4) for name, ms in kernels},
    }


def trace_steps(engine, trace_dir: Path, n: int, steps: int = 3) -> int:
    """Traces `steps` engine steps with CPU ops, Python calls and CUDA kernels into a chrome
    trace, for finding what the host did while the GPU had nothing to run."""
    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    trace_dir.mkdir(parents=True, exist_ok=True)
    with profile(activities=acts, with_stack=True) as prof:
        for _ in range(steps):
            if engine.has_unfinished_requests():
                engine.step()
    path = trace_dir / f"step{n}.json"
    prof.export_chrome_trace(str(path))
    with open(path, "rb") as raw, gzip.open(f"{path}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    path.unlink()
    return steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-8b")
    add_workload_args(parser)
    parser.add_argument("--profile-at", type=int, nargs="*", default=[40, 400])
    parser.add_argument("--profile-steps", type=int, default=8)
    parser.add_argument(
        "--trace-dir",
        type=Path,
        help="after each profiled window, trace 3 more steps with the host's Python calls "
        "(slows the host; for benchmarks/trace_gaps.py) into DIR/step<N>.json.gz",
    )
    parser.add_argument(
        "--sync-steps",
        type=int,
        default=2,
        help="steps at the first --profile-at point whose host-device syncs are printed "
        "(SYNC lines; more steps take mixed ones in)",
    )
    parser.add_argument("--deterministic", action="store_true", help="batch-invariant kernels")
    parser.add_argument(
        "--gpu-gaps",
        action="store_true",
        help="CUDA events per step: device busy vs waiting for the host (no profiler)",
    )
    parser.add_argument(
        "--gaps-min-rows",
        type=int,
        default=240,
        help="--gpu-gaps reports steps with at least this many rows",
    )
    parser.add_argument(
        "--compiles",
        action="store_true",
        help="name the Triton compiles inside the timed run (kernel, first step, seconds)",
    )
    parser.add_argument(
        "--layer-host",
        action="store_true",
        help="host ms and Triton launches per decoder-layer part and kind of step "
        "(benchmarks/layer_host.py; eager steps only: a graph replay runs no hooks)",
    )
    parser.add_argument(
        "--host-fn",
        action="append",
        default=[],
        metavar="MODULE:ATTR",
        help="with --layer-host: also time this function as a part of its own "
        "(e.g. kvloom.workers.layers.kda_layer:chunk_kda); repeatable",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cfg = SimpleNamespace(**vars(args), load_format="dummy")
    with tempfile.TemporaryDirectory() as tmp:
        engine = make_engine(str(shape_dir(args.shape, Path(tmp))), cfg)
        workload = offline_workload(cfg, engine.vocab_size)
        for i, (prompt, out_len) in enumerate(workload):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, workload_params(out_len))
        timer = PhaseTimer()
        shapes = []
        schedule = engine.scheduler.schedule

        def recorded_schedule():
            out = schedule()
            decodes = sum(1 for n in out.num_scheduled_tokens.values() if n == 1)
            shapes.append((len(out.num_scheduled_tokens), out.total_num_scheduled_tokens, decodes))
            return out

        engine.scheduler.schedule = recorded_schedule
        timer.wrap(engine.scheduler, "schedule", "schedule")
        runner = engine.executor.worker.runner
        for obj, name in (
            (runner.input_batch, "apply"),
            (runner, "build_batch"),
            (runner.model, "forward"),
            (runner, "_sample_plain"),
            (runner.graphs, "replay"),
        ):
            if obj is not None:
                timer.wrap(obj, name, name, tagged=True)
        timer.wrap_submit(engine.executor, "submit")
        timer.wrap_submit(engine.executor, "execute_model")
        timer.wrap(engine.scheduler, "update_from_output", "update_from_output")
        timer.wrap(engine.output_processor, "process", "output_processor.process")
        gaps = GpuGaps(runner) if args.gpu_gaps and torch.cuda.is_available() else None
        layer_host = None
        if args.layer_host:
            layer_host = LayerHost(
                decoder_layers(runner.model), kind_of=lambda: timer.kind, functions=args.host_fn
            )
        step_ms, profiles = [], {}
        allocator_before = allocator_counts()
        compiles = CompileWatch(step_of=lambda: len(step_ms)) if args.compiles else None
        compile_watch = compiles if compiles is not None else contextlib.nullcontext()
        with compile_watch:
            start = time.perf_counter()
            while engine.has_unfinished_requests():
                n = len(step_ms)
                if n in args.profile_at:
                    # CUDA activity only: tracing CPU ops would slow the host it measures.
                    acts = [
                        ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
                    ]
                    if torch.cuda.is_available() and n == args.profile_at[0]:
                        report_syncs(engine, steps=args.sync_steps)
                        step_ms.extend([float("nan")] * args.sync_steps)
                    t0 = time.perf_counter()
                    with profile(activities=acts) as prof:
                        for _ in range(args.profile_steps):
                            engine.step()
                    wall = (time.perf_counter() - t0) * 1e3 / args.profile_steps
                    summary = kernel_summary(prof, args.profile_steps, top=25)
                    summary["wall_ms_per_step"] = round(wall, 3)
                    summary["rows_tokens_decodes"] = shapes[-args.profile_steps :]
                    profiles[f"step{n}"] = summary
                    print(
                        f"RESULT profile_step{n} wall_ms {wall:.2f} gpu_busy_ms "
                        f"{summary['gpu_busy_ms_per_step']:.2f} shapes {shapes[-1]}"
                    )
                    step_ms.extend([wall] * args.profile_steps)
                    if args.trace_dir is not None:
                        step_ms.extend([float("nan")] * trace_steps(engine, args.trace_dir, n))
                    continue
                t0 = time.perf_counter()
                engine.step()
                step_ms.append((time.perf_counter() - t0) * 1e3)
            elapsed = time.perf_counter() - start
        allocator_after = allocator_counts()
        if layer_host is not None:
            layer_host.close()
    timed = [(ms, s) for ms, s in zip(step_ms, shapes) if ms == ms]  # sync-report steps: nan
    decode_only = [ms for ms, s in timed if s[1] == s[2]]
    mixed = [ms for ms, s in timed if s[1] != s[2]]
    result = {
        "shape": args.shape,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "seconds": round(elapsed, 2),
        "steps": len(step_ms),
        "mixed_steps": len(mixed),
        "mixed_seconds": round(sum(mixed) / 1e3, 2),
        "decode_only_steps": len(decode_only),
        "decode_only_seconds": round(sum(decode_only) / 1e3, 2),
        "host_phase_seconds": {k: round(v, 2) for k, v in timer.totals.items()},
        "max_rows": max(s[0] for s in shapes),
        "allocator": {k: allocator_after[k] - allocator_before[k] for k in ALLOCATOR_COUNTS},
        "profiles": profiles,
    }
    if gaps is not None:
        result["gpu_gaps"] = gaps.summary(shapes, args.gaps_min_rows)
        for kind, row in result["gpu_gaps"].items():
            print(f"RESULT gpu_gaps_{kind}_rows>={args.gaps_min_rows} {row}")
        result["mixed_by_prefill_tokens"] = gaps.mixed_by_prefill_tokens(shapes, args.gaps_min_rows)
        for bucket, row in result["mixed_by_prefill_tokens"].items():
            print(f"RESULT mixed_prefill_tokens{bucket} {row}")
    if layer_host is not None:
        result["layer_host"] = layer_host.summary()
        for kind, parts in result["layer_host"].items():
            for part, row in parts.items():
                print(f"RESULT layer_host {kind} {part} {row}")
    if compiles is not None:
        result["compiles"] = compiles.summary()
        print(f"RESULT compiles {result['compiles']['compiles']} seconds "
              f"{result['compiles']['seconds']}")  # fmt: skip
        for kernel, row in result["compiles"]["by_kernel"].items():
            print(f"RESULT compile {kernel} {row}")
    for key in (
        "seconds",
        "steps",
        "mixed_steps",
        "mixed_seconds",
        "decode_only_steps",
        "decode_only_seconds",
        "host_phase_seconds",
        "max_rows",
        "allocator",
    ):
        print(f"RESULT {key} {result[key]}")
    for name, summary in profiles.items():
        print(f"== {name}: top kernels (ms/step)")
        for kernel, ms in list(summary["kernels_ms_per_step"].items())[:15]:
            print(f"   {ms:8.3f}  {kernel}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
