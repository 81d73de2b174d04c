"""Times the softmax top-k router in the router GEMV's launch (`router_gemv`,
kernels/gemv_triton.py `gemv_route_triton`) against the router GEMV launch followed by
the router launch, at Qwen3-Next's router (513 x 2048: 512 experts and the shared gate,
top 10, renormalized), one and two rows, with the GEMV's chosen plan.

    python3 benchmarks/router_gemv.py --out $OUT/router_gemv.json

Each (rows, form) is captured 64 times back to back in one CUDA graph and timed by CUDA
events (benchmarks/graph_timing.py), best of 5 replays: µs per GEMV + router. Before
timing, the two forms' logits, weights and ids are compared bitwise. Without CUDA it runs
the same in Triton's CPU interpreter at one repeat (wall time: that only exercises the
script).
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

from kvloom.kernels.gemv_triton import (  # noqa: E402
    choose_gemv_plan,
    gemv_route_triton,
    gemv_triton,
)
from kvloom.kernels.moe_router_triton import router_num_warps, softmax_topk_triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import graph_timing  # noqa: E402

LAUNCHES_PER_GRAPH = 64
REPLAYS = 5
ROUTE = dict(top_k=10, renormalize=True, shared_expert_weight="sigmoid_last_logit")


def forms(rows: int, n: int, k: int, device: str) -> dict:
    """form -> a function that runs the router GEMV and the router once."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(device, torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, torch.bfloat16)

    def two_launches():
        logits = gemv_triton(x, w)
        return (logits, *softmax_topk_triton(logits, **ROUTE))

    return {"two launches": two_launches, "fused": lambda: gemv_route_triton(x, w, None, **ROUTE)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--n", type=int, default=513)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    start = time.monotonic()
    rows = []
    for m in args.rows:
        launches = forms(m, args.n, args.k, device)
        want, got = launches["two launches"](), launches["fused"]()
        same = all(torch.equal(a, b) for a, b in zip(want, got))
        plan = choose_gemv_plan(m, args.n, args.k, torch.bfloat16)
        # Where the plan's warps or K split differ from the router launch's, "fused" runs
        # the two launches too (gemv_route_triton): the row says so.
        one_launch = plan.split_k == 1 and plan.num_warps == router_num_warps(args.n - 1)
        for form, launch in launches.items():
            us = graph_timing.launch_us(launch, LAUNCHES_PER_GRAPH, REPLAYS)
            rows.append(
                dict(
                    n=args.n, k=args.k, rows=m, form=form, us=us, same_bits=same,
                    plan=plan.name, fused_in_one_launch=one_launch,
                )
            )  # fmt: skip
            print(f"RESULT router_gemv M={m} {form} us={us:.2f} same_bits={same}", flush=True)
    graph_timing.write_result(args.out, start, rows, launches_per_graph=LAUNCHES_PER_GRAPH)
    return 0 if all(row["same_bits"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
