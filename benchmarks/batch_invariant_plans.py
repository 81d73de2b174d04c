"""Tiles for the deterministic mode's matmul (issue 23): speed, and whether each tile gives
the same bits as the one plan (`MATMUL_PLAN`), on one GPU.

A tile can only be chosen by M if every element's summation order stays the same, so each
candidate's output is compared bit for bit with the one plan's on the same inputs. Times
are per call in a CUDA graph (benchmarks/graph_timing.py); cuBLAS (`F.linear`) is the
reference rate.

`--tables DIR` writes `table.json`: per range of M of `SM90_MATMUL_PLANS` the same-bits tile
of least summed time over the layers and the Ms measured in that range (a range with no M
measured keeps the current tile), and the same per weight shape ("by_shape"). Run with
the serving model's shapes (`--layers N,K ...`) on the serving GPU, the file is what
KVLOOM_DETERMINISTIC_TILES takes; `benchmarks/deterministic_cost.py --plan-tables` runs
the mode with it.

    python benchmarks/batch_invariant_plans.py --out $OUT/plans.json --tables $OUT/tables \
        [--m 64 256 512 4096] [--layers qkv o gate_up down] [--loads pointers tma persistent]

Each tile runs three ways by default: its operands loaded through pointers; moved by the
tensor-memory accelerator (`"tma": true` in the plan: host-built descriptors, the same dots
in the same order); and that with a persistent grid (`"persistent": true`: one program per
SM walking the tiles).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from graph_timing import graph_time_us

from kvloom.kernels.batch_invariant_triton import MATMUL_PLAN, SM90_MATMUL_PLANS, matmul_triton

# Qwen3-8B's linears (N, K): qkv, o, gate_up, down.
LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
# (BLOCK_M, BLOCK_N, warps): one warpgroup up to 64 x 128, two above.
TILES = (
    (64, 64, 4),
    (64, 128, 4),
    (64, 64, 8),
    (64, 256, 8),
    (128, 64, 4),
    (128, 64, 8),
    (128, 128, 8),
    (128, 256, 8),
    (256, 64, 8),
    (256, 128, 8),
)
SHARED_MEMORY_BYTES = 200 * 1024  # what the pipeline's stages may take (H100/H200: 227 KiB)


def time_ms(fn, reps: int = 10) -> float:
    """ms per call, `reps` calls captured in one CUDA graph (best of 3 replays): no host
    time, as the decode graphs run them. (Eager timing charged the bulk-copy tiles their
    host-built descriptors, 30-40% of a 256-row launch on an H100.)"""
    return graph_time_us(fn, reps, replays=3) / 1e3


# How a tile's operands are loaded: pointers, bulk-copy descriptors (TMA), or those with a
# persistent grid (one program per SM walking the tiles).
LOADS = {"pointers": {}, "tma": {"tma": True}, "persistent": {"tma": True, "persistent": True}}


def candidates(loads=tuple(LOADS)):
    """Every tile that fits, once per way of loading it in `loads`."""
    for bm, bn, warps in TILES:
        for bk in (64, 128):
            for stages in (3, 4, 5):
                if stages * (bm + bn) * bk * 2 > SHARED_MEMORY_BYTES:
                    continue
                for load in loads:
                    yield {
                        "BLOCK_M": bm,
                        "BLOCK_N": bn,
                        "BLOCK_K": bk,
                        "num_warps": warps,
                        "num_stages": stages,
                        **LOADS[load],
                    }


def plan_key(plan: dict) -> str:
    return json.dumps(plan, sort_keys=True)


def current_plan(most: int | None) -> dict:
    """The tile SM90_MATMUL_PLANS gives at `most` rows (None: its last range)."""
    if most is None:
        return SM90_MATMUL_PLANS[-1][1]
    return next(p for bound, p in SM90_MATMUL_PLANS if bound is None or most <= bound)


def best_table(
    rows: list[dict], failed: set[str] | None = None, bounds: list[int] | None = None
) -> list:
    """Per range of rows (`bounds`, ascending, a last open range added; default those of
    SM90_MATMUL_PLANS): the tile, same bits at every (layer, M) measured, whose times
    summed over the range's measured (layer, M) are least; a range with nothing measured
    keeps the current table's tile. `failed`: tiles to leave out (default: those whose
    bits differed in `rows`)."""
    if failed is None:
        failed = {plan_key(r["plan"]) for r in rows if not r["same_bits_as_plan"]}
    if bounds is None:
        bounds = [most for most, _ in SM90_MATMUL_PLANS if most is not None]
    table, low = [], 0
    for most in [*bounds, None]:
        current = current_plan(most)
        inside = [r for r in rows if r["m"] > low and (most is None or r["m"] <= most)]
        cases = {(r["layer"], r["m"]) for r in inside}
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for r in inside:
            key = plan_key(r["plan"])
            sums[key] = sums.get(key, 0.0) + r["ms"]
            counts[key] = counts.get(key, 0) + 1
        complete = [k for k in sums if k not in failed and counts[k] == len(cases)]
        pick = json.loads(min(complete, key=sums.get)) if complete else current
        table.append([most, pick])
        low = most or low
    return table


def tables(rows: list[dict], bounds: list[int] | None = None) -> dict:
    """The table file: one table over every layer measured, and one per weight shape
    ("N,K"), each without any tile whose bits differed anywhere in the sweep."""
    failed = {plan_key(r["plan"]) for r in rows if not r["same_bits_as_plan"]}
    shapes = sorted({(r["n"], r["k"]) for r in rows})
    return {
        "plans": best_table(rows, failed, bounds),
        "by_shape": {
            f"{n},{k}": best_table([r for r in rows if (r["n"], r["k"]) == (n, k)], failed, bounds)
            for n, k in shapes
        },
    }


def layer_shape(name: str) -> tuple[int, int]:
    """(N, K) of a layer named in LAYERS, or given as "N,K"."""
    if name in LAYERS:
        return LAYERS[name]
    try:
        n, k = (int(part) for part in name.split(","))
    except ValueError:
        raise SystemExit(f"--layers: {name!r} is neither one of {list(LAYERS)} nor 'N,K'") from None
    return n, k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[64, 256, 512, 4096])
    parser.add_argument(
        "--layers", nargs="+", default=list(LAYERS), help="names of LAYERS, or weight shapes N,K"
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tables", type=Path, help="folder for the table file")
    parser.add_argument(
        "--bounds",
        type=int,
        nargs="+",
        default=None,
        help="the table's row ranges' upper bounds (default: the built-in table's)",
    )
    parser.add_argument(
        "--loads",
        nargs="+",
        choices=list(LOADS),
        default=list(LOADS),
        help="ways to load each tile: pointers, bulk-copy descriptors (Hopper's TMA), "
        "those with a persistent grid",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for name in args.layers:
        n, k = layer_shape(name)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = matmul_triton(x, w, plan=MATMUL_PLAN)
            current_ms = time_ms(lambda x=x, w=w: matmul_triton(x, w))
            cublas_ms = time_ms(lambda x=x, w=w: F.linear(x, w))
            best = None
            for plan in candidates(args.loads):
                run = lambda x=x, w=w, p=plan: matmul_triton(x, w, plan=p)  # noqa: E731
                try:
                    out = run()
                    ms = time_ms(run)
                except Exception as err:  # out of resources: not a candidate here
                    print(f"skip {plan}: {type(err).__name__}")
                    continue
                row = {
                    "layer": name,
                    "n": n,
                    "k": k,
                    "m": m,
                    "plan": plan,
                    "ms": round(ms, 4),
                    # int16 views: bits, not values (-0.0 and +0.0 would compare equal)
                    "same_bits_as_plan": torch.equal(out.view(torch.int16), base.view(torch.int16)),
                }
                rows.append(row)
                if row["same_bits_as_plan"] and (best is None or ms < best["ms"]):
                    best = row
            summary = {
                "layer": name,
                "m": m,
                "current_table_ms": round(current_ms, 4),
                "cublas_ms": round(cublas_ms, 4),
                "cublas_tflops": round(2 * m * n * k / cublas_ms / 1e9, 1),
                "best_same_bits": best,
                "tiles_with_other_bits": sum(
                    not r["same_bits_as_plan"] for r in rows if (r["layer"], r["m"]) == (name, m)
                ),
            }
            print("RESULT", json.dumps(summary), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"one_plan": MATMUL_PLAN, "rows": rows}, indent=2))
    if args.tables:
        args.tables.mkdir(parents=True, exist_ok=True)
        table = tables(rows, args.bounds)
        (args.tables / "table.json").write_text(json.dumps(table, indent=2))
        print("TABLE", json.dumps(table), flush=True)


if __name__ == "__main__":
    main()
