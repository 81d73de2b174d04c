"""Times the residual add and RMSNorm in an output projection's GEMV launch
(`linear_add_norm`, kernels/gemv_triton.py `gemv_add_rms_norm_triton`) against the GEMV
launch followed by the norm launch, at the decode shapes' output projections (N x K):
Qwen3-Next's GDN out_proj and attention o_proj (2048 x 4096, zero-centred norm) and
Qwen3-8B's o_proj (4096 x 4096), one and two rows, with the GEMV's chosen plan.

    python3 benchmarks/gemv_add_norm.py --out $OUT/gemv_add_norm.json

Each (shape, rows, form) is captured 64 times back to back in one CUDA graph and timed by
CUDA events (benchmarks/graph_timing.py), best of 5 replays: µs per projection + norm.
Before timing, the two forms' normed rows and new residual are compared bitwise. Without
CUDA it runs the same in Triton's CPU interpreter at one repeat (wall time: that only
exercises the script).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before triton is imported: it reads this once
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvloom.kernels.gemv import ADD_NORM_GEMV_MAX_M  # noqa: E402
from kvloom.kernels.gemv_triton import (  # noqa: E402
    choose_gemv_plan,
    gemv_add_rms_norm_triton,
    gemv_triton,
)
from kvloom.kernels.rms_norm_triton import rms_norm_triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import graph_timing  # noqa: E402

LAUNCHES_PER_GRAPH = 64
REPLAYS = 5
EPS = 1e-6
SHAPES = {"qwen3-next out_proj": (2048, 4096, 1.0), "qwen3-8b o_proj": (4096, 4096, 0.0)}


def forms(rows: int, n: int, k: int, offset: float, device: str) -> dict:
    """form -> a function that runs the projection and the norm once."""
    gen = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, k, generator=gen).to(device, torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, torch.bfloat16)
    residual = (3 * torch.randn(rows, n, generator=gen)).to(device, torch.bfloat16)
    norm_w = (1 + 0.3 * torch.randn(n, generator=gen)).to(device, torch.bfloat16)

    def two_launches():
        return rms_norm_triton(gemv_triton(x, w), norm_w, EPS, residual, offset)

    def fused():
        return gemv_add_rms_norm_triton(x, w, None, residual, norm_w, EPS, weight_offset=offset)

    return {"two launches": two_launches, "fused": fused}


def parse_shape(text: str) -> tuple[str, tuple[int, int, float]]:
    n, k = (int(v) for v in text.split(","))
    return f"{n}x{k}", (n, k, 0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--shapes", nargs="+", default=None, help="N,K pairs (default: SHAPES)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    shapes = dict(map(parse_shape, args.shapes)) if args.shapes else SHAPES
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    start = time.monotonic()
    rows = []
    for name, (n, k, offset) in shapes.items():
        for m in args.rows:
            launches = forms(m, n, k, offset, device)
            want, got = launches["two launches"](), launches["fused"]()
            same = all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
            plan = choose_gemv_plan(m, n, k, torch.bfloat16)
            # Where the plan splits K or the rows exceed the epilogue's, "fused" runs the
            # two launches too (gemv_add_rms_norm_triton): the row says so.
            one_launch = plan.split_k == 1 and m <= ADD_NORM_GEMV_MAX_M
            for form, launch in launches.items():
                us = graph_timing.launch_us(launch, LAUNCHES_PER_GRAPH, REPLAYS)
                rows.append(
                    dict(
                        shape=name, n=n, k=k, rows=m, form=form, us=us, same_bits=same,
                        plan=plan.name, fused_in_one_launch=one_launch,
                    )
                )  # fmt: skip
                print(
                    f"RESULT gemv_add_norm {name} M={m} {form} us={us:.2f} same_bits={same}",
                    flush=True,
                )
    graph_timing.write_result(args.out, start, rows, launches_per_graph=LAUNCHES_PER_GRAPH)
    return 0 if all(row["same_bits"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
