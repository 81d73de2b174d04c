"""Times the fused MoE routers' pick plans (kernels/moe_router_triton.py): one key from
each max reduction against two (`picks_per_round`, the same bits), at Qwen3-Next's router
(softmax over 512 experts, top 10, the shared gate as a 513th column) and Kimi-Linear's
(sigmoid over 256 experts with a bias, top 8, scaled, a shared route of weight 1).

    python3 benchmarks/router_picks.py --out $OUT/router_picks.json

Each (router, tokens, plan) is captured 64 times back to back in one CUDA graph and timed
by CUDA events (benchmarks/graph_timing.py), best of 5 replays: µs per launch. Before
timing, the plans' ids and weights are compared bitwise. Without CUDA it runs the same in
Triton's CPU interpreter at one repeat (wall time: that only exercises the script).
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

from kvloom.kernels.moe_router_triton import (  # noqa: E402
    sigmoid_topk_triton,
    softmax_topk_triton,
)

sys.path.insert(0, str(Path(__file__).parent))
import graph_timing  # noqa: E402

LAUNCHES_PER_GRAPH = 64
REPLAYS = 5


def routers(tokens: int, device: str) -> dict:
    """name -> a function of picks_per_round that launches that router once."""
    gen = torch.Generator().manual_seed(tokens)
    qwen = torch.randn(tokens, 513, generator=gen).to(device, torch.bfloat16)
    kimi = torch.randn(tokens, 256, generator=gen).to(device)
    bias = (torch.randn(256, generator=gen) / 10).to(device)
    return {
        "qwen3-next softmax 512/10": lambda picks: softmax_topk_triton(
            qwen, 10, True, "sigmoid_last_logit", picks_per_round=picks
        ),
        "kimi-linear sigmoid 256/8": lambda picks: sigmoid_topk_triton(
            kimi, bias, 8, True, 2.446, "one", picks_per_round=picks
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 64, 1024])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    start = time.monotonic()
    rows = []
    for tokens in args.tokens:
        for name, launch in routers(tokens, device).items():
            one, two = launch(1), launch(2)
            same = torch.equal(one[1], two[1]) and torch.equal(
                one[0].view(torch.int8), two[0].view(torch.int8)
            )
            for picks in (1, 2):
                us = graph_timing.launch_us(
                    lambda launch=launch, picks=picks: launch(picks), LAUNCHES_PER_GRAPH, REPLAYS
                )
                rows.append(
                    dict(router=name, tokens=tokens, picks_per_round=picks, us=us, same_bits=same)
                )
                print(
                    f"RESULT {name} T={tokens} picks={picks} us={us:.2f} same_bits={same}",
                    flush=True,
                )
    graph_timing.write_result(args.out, start, rows, launches_per_graph=LAUNCHES_PER_GRAPH)
    return 0 if all(row["same_bits"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
