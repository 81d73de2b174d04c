"""Where a batch-1 decode step's device time goes, kernel by kernel and gap by gap.

Builds the engine on a `kvloom bench` shape (dummy weights, CUDA graphs on), decodes one
request to steady state, then records a few engine steps with torch.profiler (kernels inside
a CUDA graph replay are traced one by one). For the last recorded step it prints, per
kernel name: launches, summed duration, and the summed idle time just before those
launches (the gap since the previous kernel ended): the launch-to-launch cost that no
kernel's own time shows.

    python benchmarks/decode_timeline.py [--shape qwen3-8b] [--steps 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kvloom import Engine, SamplingParams
from kvloom.cluster.bench import shape_dir

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def device_events(trace: Path) -> list[dict]:
    opener = gzip.open if trace.suffix == ".gz" else open
    with opener(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    spans = [e for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e]
    return sorted(spans, key=lambda e: e["ts"])


def split_steps(spans: list[dict], min_gap_us: float) -> list[list[dict]]:
    """Device work grouped into steps: a gap longer than min_gap_us starts a new one."""
    steps: list[list[dict]] = []
    end = None
    for e in spans:
        if end is None or e["ts"] - end > min_gap_us:
            steps.append([])
        steps[-1].append(e)
        end = max(end or 0.0, e["ts"] + e["dur"])
    return steps


def launch_grid(event: dict) -> str:
    """A kernel event's grid as "x,y,z" (the profiler's args), "" where it has none
    (copies, memsets)."""
    grid = event.get("args", {}).get("grid")
    return ",".join(str(g) for g in grid) if grid else ""


def summarize(step: list[dict]) -> dict:
    per_name: dict[str, dict] = defaultdict(
        lambda: dict(launches=0, busy_us=0.0, gap_before_us=0.0)
    )
    end = None
    for e in step:
        row = per_name[e["name"][:80]]
        row["launches"] += 1
        row["busy_us"] += e["dur"]
        if end is not None:
            row["gap_before_us"] += max(0.0, e["ts"] - end)
        end = max(end or 0.0, e["ts"] + e["dur"])
    shapes: dict[tuple[str, str], dict] = defaultdict(lambda: dict(launches=0, busy_us=0.0))
    for e in step:
        row = shapes[(e["name"][:80], launch_grid(e))]
        row["launches"] += 1
        row["busy_us"] += e["dur"]
    span = step[-1]["ts"] + step[-1]["dur"] - step[0]["ts"]
    busy = sum(r["busy_us"] for r in per_name.values())
    rows = sorted(per_name.items(), key=lambda kv: -(kv[1]["busy_us"] + kv[1]["gap_before_us"]))
    return dict(
        span_us=round(span, 1),
        busy_us=round(busy, 1),
        gaps_us=round(sum(r["gap_before_us"] for r in per_name.values()), 1),
        launches=len(step),
        kernels=[{"name": name, **{k: round(v, 1) for k, v in r.items()}} for name, r in rows],
        # The same kernel at each grid it launched with (a GEMV per weight shape): where
        # one kernel name covers launches of different sizes, which of them are slow.
        launch_shapes=[
            dict(
                name=name,
                grid=grid,
                launches=r["launches"],
                busy_us=round(r["busy_us"], 1),
                us_per_launch=round(r["busy_us"] / r["launches"], 2),
            )
            for (name, grid), r in sorted(shapes.items(), key=lambda kv: -kv[1]["busy_us"])
        ],
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--min-gap-us", type=float, default=200.0, help="a step boundary")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(
            model=str(shape_dir(args.shape, Path(tmp))),
            dtype="bfloat16",
            load_format="dummy",
            device="cuda",
            max_num_seqs=8,
            max_model_len=4096,
            progress=False,
            async_scheduling=False,  # each step's device work apart from the next one's
        )
        engine.add_request(
            "r",
            {"prompt_token_ids": list(range(10, 138))},
            SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True, detokenize=False),
        )
        for _ in range(20):  # prefill, then steady decode
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                engine.step()
                torch.cuda.synchronize()
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        steps = split_steps(device_events(trace), args.min_gap_us)
    result = dict(
        shape=args.shape,
        device=torch.cuda.get_device_name(),
        steps_found=len(steps),
        step=summarize(max(steps[1:] or steps, key=len)),
    )
    step = result["step"]
    print(
        f"RESULT span_us {step['span_us']} busy_us {step['busy_us']} gaps_us {step['gaps_us']} "
        f"launches {step['launches']}"
    )
    for row in step["kernels"][:20]:
        print(
            f"{row['launches']:5d} {row['busy_us']:9.1f} us busy {row['gap_before_us']:8.1f} us "
            f"gaps before  {row['name']}"
        )
    print("by grid:")
    for row in step["launch_shapes"][:16]:
        print(
            f"{row['launches']:5d} x {row['us_per_launch']:7.2f} us  grid {row['grid']:>12}  "
            f"{row['name'][:60]}"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
