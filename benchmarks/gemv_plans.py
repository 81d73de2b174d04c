"""Times gemv_triton's candidate plans against cuBLAS (F.linear) at decode shapes.

Prints the best plan per shape and batch as GEMV_PLAN_TABLE entries (dense-model shapes).

    python3 benchmarks/gemv_plans.py --out $OUT/gemv_plans.json

Each (shape, M, implementation) is timed inside one captured CUDA graph of
LAUNCHES_PER_GRAPH back-to-back launches that rotate over several copies of the weight,
so a weight is re-read only after more than L2_FLUSH_BYTES of other weights streamed
through L2 (50 MiB on an H200): every launch reads its weight from HBM, as in decode.
Reported: µs per launch and GB/s of weight bytes. Each plan is first checked against
gemv_ref (error in the output dtype's ulps) and, bitwise, against the first plan with the
same split_k (the kernel promises equal bits across such plans).

`--budget-s` stops trying new plans once spent (compiles dominate: every plan compiles
once per M); `--tiny` runs small shapes, also on a CPU under TRITON_INTERPRET=1, where
"µs" is the wall time of one interpreted call (only good for exercising this script).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kvloom.kernels.gemv import gemv_ref
from kvloom.kernels.gemv_triton import (
    GEMV_MAX_M,
    GemvPlan,
    check_plan_table,
    default_gemv_plan,
    gemv_triton,
    is_even_k,
)

sys.path.insert(0, str(Path(__file__).parent))  # as a module of tests too
import graph_timing  # noqa: E402

# (K, N): Qwen3-8B qkv, o_proj, gate_up, down; then 1.7B/4B-class and small projections.
SHAPES_KN = (
    (4096, 6144),
    (4096, 4096),
    (4096, 24576),
    (12288, 4096),
    (2048, 12288),
    (4096, 2048),
    (2048, 9216),
    (2048, 1024),
    (512, 2048),
)
BATCHES = (1, 2, 4, 8)
LAUNCHES_PER_GRAPH = 64
REPLAYS = 5
L2_FLUSH_BYTES = 100 * 2**20

# (block_n, block_k, num_warps, num_stages, split_k). block_n / num_warps = 4 gives each
# thread 8 elements (16 bytes of bf16) of a 64-lane chunk; other ratios are variations.
# num_stages > 1 pipelines every load of the K loop through shared memory (cp.async), the
# x chunk of each row included, so compile time grows with M * block_k / 64 (measured on
# a 2-core CPU for M = 8: ~2 s at 1-2 chunks per step, ~7-10 s at 4, ~25 s at 8): deep
# pipelines of short steps are the main family. num_stages = 1 issues plain loads, about
# two 16-byte loads in flight per thread (ptxas does not hoist further), measured here
# for comparison. The defaults of default_gemv_plan come first (before any budget cut).
CANDIDATES = tuple(
    GemvPlan(*p)
    for p in (
        (4, 128, 1, 6, 1),
        (8, 128, 2, 6, 1),
        (16, 128, 4, 6, 1),
        (32, 128, 8, 6, 1),
        (8, 128, 2, 4, 1),
        (16, 128, 4, 4, 1),
        (32, 128, 8, 4, 1),
        (8, 128, 2, 8, 1),
        (16, 128, 4, 8, 1),
        (8, 64, 2, 8, 1),
        (16, 64, 4, 8, 1),
        (32, 64, 8, 8, 1),
        (64, 64, 8, 6, 1),
        (64, 128, 8, 4, 1),
        (16, 128, 8, 6, 1),
        (32, 128, 4, 6, 1),
        (8, 256, 2, 4, 1),
        (16, 256, 4, 4, 1),
        (32, 256, 8, 3, 1),
        (16, 512, 4, 1, 1),
        (32, 512, 8, 1, 1),
        (8, 1024, 2, 1, 1),
        (8, 128, 2, 6, 2),
        (16, 128, 4, 6, 2),
        (4, 128, 1, 6, 4),
        (8, 128, 2, 6, 4),
    )
)
TINY_SHAPES_KN = ((192, 40), (100, 24))
TINY_BATCHES = (1, 8)
TINY_CANDIDATES = (GemvPlan(8, 64, 2, 2, 1), GemvPlan(16, 128, 4, 1, 1), GemvPlan(4, 64, 1, 2, 2))


def weight_copies(weight_bytes: int, flush_bytes: int = L2_FLUSH_BYTES) -> int:
    """Copies to rotate so a copy is re-read only after > flush_bytes of the others."""
    return max(2, -(-flush_bytes // weight_bytes) + 1)


def reuse_distance_bytes(weight_bytes: int, copies: int) -> int:
    """Bytes of other weights read between two reads of one copy inside the graph loop."""
    return (min(copies, LAUNCHES_PER_GRAPH) - 1) * weight_bytes


def gbps(weight_bytes: int, us: float) -> float:
    return weight_bytes / us / 1e3


def ulp_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |got - ref| in units of the last place of ref's dtype at |ref|."""
    ref64 = ref.double()
    _, exp = torch.frexp(ref64.abs().clamp_min(torch.finfo(ref.dtype).tiny))
    mantissa = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[ref.dtype]
    ulp = torch.ldexp(torch.ones_like(ref64), exp - 1 - mantissa)
    return ((got.double() - ref64).abs() / ulp).max().item() if got.numel() else 0.0


def pick_plans(
    times: dict[int, dict[str, float]], plans: dict[str, GemvPlan]
) -> dict[int, GemvPlan]:
    """Best plan per M, all of one split_k (the kernel's bits depend on split_k, so a shape
    keeps one): the split_k with the lowest sum over M of its fastest plan, then that
    split_k's fastest plan per M. Unmeasured (NaN) times never win; {} if nothing fits."""
    best_total, best_split = math.inf, None
    for split in sorted({p.split_k for p in plans.values()}):
        total = 0.0
        for by_plan in times.values():
            ok = [t for name, t in by_plan.items() if plans[name].split_k == split and t == t]
            total += min(ok) if ok else math.inf
        if total < best_total:
            best_total, best_split = total, split
    if best_split is None:
        return {}
    picks = {}
    for m, by_plan in times.items():
        ok = {n: t for n, t in by_plan.items() if plans[n].split_k == best_split and t == t}
        picks[m] = plans[min(ok, key=ok.get)]
    return picks


def format_table(
    table: dict[tuple[int, int], dict[int, GemvPlan]], notes: dict | None = None
) -> str:
    """GEMV_PLAN_TABLE source text; notes[(n, k)][m] is an optional trailing comment."""
    notes = notes or {}
    lines = ["GEMV_PLAN_TABLE: dict[tuple[int, int], dict[int, GemvPlan]] = {"]
    for (n, k), by_m in table.items():
        lines.append(f"    ({n}, {k}): {{  # N, K")
        for m, p in sorted(by_m.items()):
            plan = f"GemvPlan({p.block_n}, {p.block_k}, {p.num_warps}, {p.num_stages}, {p.split_k})"
            note = notes.get((n, k), {}).get(m)
            lines.append(f"        {m}: {plan}," + (f"  # {note}" if note else ""))
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines)


def time_graph_us(launch: Callable[[int], object], copies: int) -> float:
    """µs per launch of `launch(i)` (i: weight copy) captured LAUNCHES_PER_GRAPH times
    back to back in one CUDA graph, replayed REPLAYS times after one warm replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compiles / warms up outside the capture
        launch(0)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAUNCHES_PER_GRAPH):
            launch(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) * 1e3 / (REPLAYS * LAUNCHES_PER_GRAPH)


def time_wall_us(launch: Callable[[int], object], copies: int) -> float:
    """No GPU: wall time of one call (interpreter; exercises the script only)."""
    begin = time.perf_counter()
    launch(0)
    return (time.perf_counter() - begin) * 1e6


def bench_shape(k, n, batches, candidates, device, timer, deadline, compiled, log) -> list[dict]:
    """Rows of results for one (K, N) over the batches: cuBLAS first, then each plan.
    Past `deadline` only (plan, M, K alignment) variants already compiled run (`compiled`)."""
    dtype = torch.bfloat16
    weight_bytes = n * k * 2
    copies = weight_copies(weight_bytes) if device.type == "cuda" else 1
    gen = torch.Generator(device=device).manual_seed(k * 7919 + n)
    weights = [
        (torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(dtype) for _ in range(copies)
    ]
    rows = []
    for m in batches:
        x = torch.randn(m, k, generator=gen, device=device).to(dtype)
        ref = gemv_ref(x, weights[0])
        us = timer(lambda i, x=x: F.linear(x, weights[i]), copies)
        rows.append(dict(k=k, n=n, m=m, impl="cublas", us=us, GBps=gbps(weight_bytes, us)))
        log(f"RESULT k={k} n={n} m={m} impl=cublas us={us:.2f} GBps={gbps(weight_bytes, us):.0f}")
        first_of_split: dict[int, torch.Tensor] = {}
        for plan in candidates:
            key = (plan.name, m, is_even_k(k, plan))  # what a compile depends on here
            if time.monotonic() > deadline and key not in compiled:
                rows.append(dict(k=k, n=n, m=m, impl=plan.name, skipped="budget"))
                log(f"SKIPPED k={k} n={n} m={m} impl={plan.name} (budget spent)")
                continue
            compiled.add(key)
            try:  # one failing plan (say, out of shared memory) must not end the run
                begin = time.monotonic()
                out = gemv_triton(x, weights[0], plan=plan)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                first_call_s = time.monotonic() - begin  # mostly compile time
                peer = first_of_split.setdefault(plan.split_k, out)
                same_bits = bool(torch.equal(out, peer))
                err = ulp_error(out, ref)
                us = timer(lambda i, x=x, p=plan: gemv_triton(x, weights[i], plan=p), copies)
            except Exception as exc:
                rows.append(dict(k=k, n=n, m=m, impl=plan.name, error=repr(exc)[:500]))
                log(f"ERROR k={k} n={n} m={m} impl={plan.name}: {repr(exc)[:500]}")
                continue
            rows.append(
                dict(
                    k=k,
                    n=n,
                    m=m,
                    impl=plan.name,
                    plan=list(_plan_fields(plan)),
                    us=us,
                    GBps=gbps(weight_bytes, us),
                    max_ulp_vs_ref=err,
                    same_bits_as_split_peer=same_bits,
                    first_call_s=first_call_s,
                )
            )
            flag = "" if same_bits and err <= 1.0 else " WARN"
            log(
                f"RESULT k={k} n={n} m={m} impl={plan.name} us={us:.2f} "
                f"GBps={gbps(weight_bytes, us):.0f} ulp={err:.2f} same_bits={same_bits}"
                f" first_call_s={first_call_s:.2f}{flag}"
            )
    weights.clear()  # free the copies before the next shape
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def summarize(rows: list[dict], candidates, log) -> tuple[dict, dict]:
    """(table, notes): best plans per (N, K) by pick_plans, logged as BEST lines."""
    plans = {p.name: p for p in candidates}
    table, notes = {}, {}
    shapes = dict.fromkeys((r["k"], r["n"]) for r in rows)
    for k, n in shapes:
        mine = [r for r in rows if (r["k"], r["n"]) == (k, n)]
        times: dict[int, dict[str, float]] = {}
        cublas = {}
        for r in mine:
            if r["impl"] == "cublas":
                cublas[r["m"]] = r["us"]
            elif "us" in r and r["same_bits_as_split_peer"]:
                times.setdefault(r["m"], {})[r["impl"]] = r["us"]
        picks = pick_plans(times, plans)
        if set(picks) != set(cublas):
            log(f"NOPICK k={k} n={n}: no split_k has a measured plan for every M")
            continue
        table[(n, k)] = picks
        notes[(n, k)] = {}
        for m, plan in sorted(picks.items()):
            us = times[m][plan.name]
            speedup = cublas[m] / us
            notes[(n, k)][m] = f"{us:.1f} us, {gbps(n * k * 2, us):.0f} GB/s, {speedup:.2f}x cuBLAS"
            log(
                f"BEST k={k} n={n} m={m} plan={plan.name} us={us:.2f} "
                f"GBps={gbps(n * k * 2, us):.0f} cublas_us={cublas[m]:.2f} speedup={speedup:.2f}"
            )
    return table, notes


def _plan_fields(plan: GemvPlan):
    return (plan.block_n, plan.block_k, plan.num_warps, plan.num_stages, plan.split_k)


def parse_shape(text: str) -> tuple[int, int]:
    """ "K,N" -> (K, N), both positive."""
    try:
        k, n = (int(part) for part in text.split(","))
    except ValueError:
        raise SystemExit(f"--shapes: expected K,N (two integers), got {text!r}") from None
    if k < 1 or n < 1:
        raise SystemExit(f"--shapes: K and N must be positive, got {text!r}")
    return k, n


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="JSON results")
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU interpreter)")
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop new plans after")
    parser.add_argument(
        "--shapes",
        nargs="+",
        metavar="K,N",
        help="these (K, N) weight shapes instead of the dense-model ones "
        "(Kimi-Linear's: 4096,2304 9216,2304 2304,576)",
    )
    args = parser.parse_args(argv)
    start = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = TINY_SHAPES_KN if args.tiny else SHAPES_KN
    if args.shapes:
        shapes = tuple(parse_shape(text) for text in args.shapes)
    batches = TINY_BATCHES if args.tiny else BATCHES
    candidates = TINY_CANDIDATES if args.tiny else CANDIDATES
    timer = time_graph_us if device.type == "cuda" else time_wall_us
    rows: list[dict] = []
    compiled: set = set()
    for k, n in shapes:
        deadline = start + args.budget_s
        rows += bench_shape(k, n, batches, candidates, device, timer, deadline, compiled, print)
    table, notes = summarize(rows, candidates, print)
    if table and max(batches) == GEMV_MAX_M:
        check_plan_table(table)
        print("# paste into kernels/gemv_triton.py:")
        print(format_table(table, notes))
    defaults = {f"{n}x{k}": default_gemv_plan(n, k).name for k, n in shapes}
    return graph_timing.write_result(
        args.out,
        start,
        rows,
        launches_per_graph=LAUNCHES_PER_GRAPH,
        replays=REPLAYS,
        l2_flush_bytes=L2_FLUSH_BYTES,
        default_plans=defaults,
        table={f"{n}x{k}": {m: p.name for m, p in by_m.items()} for (n, k), by_m in table.items()},
    )


if __name__ == "__main__":
    main()
