"""Times the gated MLP's gate_up at decode sizes: the fused GEMV + SiLU-and-mul launch
(`gemv_silu_and_mul_triton`) against the two launches it replaces (`gemv_triton`, then
`silu_and_mul_triton`), with cuBLAS + the activation launch for context.

    python3 benchmarks/gemv_silu_fusion.py --out $OUT/gemv_silu_fusion.json

Timing as benchmarks/gemv_plans.py: each (shape, M, implementation) is captured
LAUNCHES_PER_GRAPH times back to back in one CUDA graph, rotating over copies of the
weight so every launch streams its weight from HBM, and timed with CUDA events over the
replays; µs per gate_up step (one or two launches) and GB/s of weight bytes. Before
timing, the fused output is compared bitwise with the two launches'. `--tiny` runs small
shapes, also on a CPU under TRITON_INTERPRET=1 (wall time of one call: exercises the
script only).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvloom.kernels.activation_triton import silu_and_mul_triton
from kvloom.kernels.gemv_triton import choose_gemv_plan, gemv_silu_and_mul_triton, gemv_triton

sys.path.insert(0, str(Path(__file__).parent))
import graph_timing  # noqa: E402
from gemv_plans import (  # noqa: E402
    L2_FLUSH_BYTES,
    LAUNCHES_PER_GRAPH,
    REPLAYS,
    gbps,
    time_graph_us,
    time_wall_us,
    weight_copies,
)

# (K, I): Qwen3-8B's MLP (gate_up weight [2I, K]); Qwen3-1.7B's; MoE shared experts of
# I = 768 and Qwen3-Next's I = 512.
SHAPES_KI = ((4096, 12288), (2048, 6144), (2048, 768), (2048, 512))
BATCHES = (1, 2)
TINY_SHAPES_KI = ((200, 37),)


def implementations(x: torch.Tensor, weights: list[torch.Tensor]) -> dict:
    """name -> launch(i) on weight copy i."""
    return {
        "cublas+silu": lambda i: silu_and_mul_triton(F.linear(x, weights[i])),
        "gemv+silu": lambda i: silu_and_mul_triton(gemv_triton(x, weights[i])),
        "fused": lambda i: gemv_silu_and_mul_triton(x, weights[i]),
    }


def bench_shape(k: int, i: int, batches, device, timer, log) -> list[dict]:
    dtype = torch.bfloat16
    weight_bytes = 2 * i * k * 2
    copies = weight_copies(weight_bytes) if device.type == "cuda" else 1
    gen = torch.Generator(device=device).manual_seed(k * 7919 + i)
    weights = [
        (torch.randn(2 * i, k, generator=gen, device=device) * k**-0.5).to(dtype)
        for _ in range(copies)
    ]
    rows = []
    for m in batches:
        x = torch.randn(m, k, generator=gen, device=device).to(dtype)
        plan = choose_gemv_plan(m, 2 * i, k, dtype)
        launches = implementations(x, weights)
        same_bits = bool(torch.equal(launches["fused"](0), launches["gemv+silu"](0)))
        times = {name: timer(launch, copies) for name, launch in launches.items()}
        for name, us in times.items():
            row = dict(k=k, i=i, m=m, impl=name, us=us, GBps=gbps(weight_bytes, us))
            if name == "fused":
                row.update(
                    plan=plan.name,
                    same_bits_as_two_launches=same_bits,
                    speedup_vs_two_launches=times["gemv+silu"] / us,
                )
            rows.append(row)
            log(
                f"RESULT k={k} i={i} m={m} impl={name} us={us:.2f} "
                f"GBps={gbps(weight_bytes, us):.0f}"
            )
        flag = "" if same_bits else " WARN"
        log(
            f"FUSION k={k} i={i} m={m} plan={plan.name} "
            f"speedup_vs_two_launches={times['gemv+silu'] / times['fused']:.3f} "
            f"same_bits={same_bits}{flag}"
        )
    weights.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="JSON results")
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU interpreter)")
    args = parser.parse_args(argv)
    start = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = TINY_SHAPES_KI if args.tiny else SHAPES_KI
    timer = time_graph_us if device.type == "cuda" else time_wall_us
    rows: list[dict] = []
    for k, i in shapes:
        rows += bench_shape(k, i, BATCHES, device, timer, print)
    return graph_timing.write_result(
        args.out,
        start,
        rows,
        launches_per_graph=LAUNCHES_PER_GRAPH,
        replays=REPLAYS,
        l2_flush_bytes=L2_FLUSH_BYTES,
    )


if __name__ == "__main__":
    main()
