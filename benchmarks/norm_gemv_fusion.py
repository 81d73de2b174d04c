"""Times a decoder layer's RMSNorm + the projection after it at decode sizes: the GEMV with
the norm in its prologue (`rms_norm_gemv_triton`, one launch) against the two launches it
replaces (`rms_norm_triton` with the residual add, then `gemv_triton` or
`gemv_silu_and_mul_triton`).

    python3 benchmarks/norm_gemv_fusion.py --out $OUT/norm_gemv_fusion.json

Timing as benchmarks/gemv_plans.py: each (shape, M, implementation) is captured
LAUNCHES_PER_GRAPH times back to back in one CUDA graph, rotating over copies of the
weight so every launch streams its weight from HBM, and timed with CUDA events over the
replays; µs per norm + projection (one or two launches) and GB/s of weight bytes. The
fused launch runs with the GEMV's chosen plan ("fused") and with wider tiles of the same
split_k ("fused_<plan>": fewer programs recompute the norm statistic). Before timing,
every fused output (y, new residual) is compared bitwise with the two launches'.
Gated DeltaNet's in_proj (a shape with conv channels) also times its decode conv update
in the GEMV's epilogue (`rms_norm_gemv_conv_triton`, "conv:fused", one launch) against
the norm + GEMV launch followed by the conv update launch ("conv:two_launches", what
KVLOOM_UNFUSED=gdn_conv runs), each over a float32 conv state pool of one slot a row,
compared bitwise first (y, residual, conv output, pool).
`--tiny` runs small shapes, also on a CPU under TRITON_INTERPRET=1 (wall time of one
call: exercises the script only).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from kvloom.kernels.causal_conv1d_triton import causal_conv1d_update_triton
from kvloom.kernels.gemv_triton import (
    GemvPlan,
    choose_gemv_plan,
    gemv_silu_and_mul_triton,
    gemv_triton,
    rms_norm_gemv_conv_triton,
    rms_norm_gemv_triton,
)
from kvloom.kernels.rms_norm_triton import rms_norm_triton

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

EPS = 1e-6
CONV_WIDTH = 4  # Qwen3-Next's linear_conv_kernel_dim
# (name, K, weight rows, SiLU-and-mul, weight_offset, conv channels): the projections that
# read a norm; conv channels > 0: Gated DeltaNet's in_proj, whose first columns feed the
# conv (2 * 16 * 128 + 32 * 128 at TP 1).
SHAPES = (
    ("qwen3_8b.qkv_proj", 4096, 6144, False, 0.0, 0),
    ("qwen3_8b.gate_up_proj", 4096, 24576, True, 0.0, 0),
    ("qwen3_next.gdn_in_proj", 2048, 12352, False, 1.0, 8192),
    ("qwen3_next.attn_qkv_proj", 2048, 9216, False, 1.0, 0),
    ("qwen3_next.moe_router", 2048, 512, False, 1.0, 0),
)
BATCHES = (1, 2)
TINY_SHAPES = (("tiny", 200, 74, False, 1.0, 40), ("tiny.silu", 200, 74, True, 0.0, 0))


def fused_plan_variants(plan: GemvPlan) -> dict[str, GemvPlan]:
    """Other tilings than the GEMV's chosen plan (same split_k, so the same bits). Wider
    tiles: every program recomputes the rows' 1 / rms, so fewer programs may pay off for
    the fused launch even where the plain GEMV prefers narrow tiles. Narrower tiles and
    the chosen plan without software pipelining (num_stages 1): built for sm_90, fused
    decode plans used to keep 128-2,080 bytes per thread in a stack frame (register
    spills, benchmarks/norm_gemv_stack_frames.py), from the norm's pairwise tree; since
    588bb64 none of this benchmark's 49 builds spills (Triton 3.6)."""
    variants = {}
    for block_n in (16, 32, 64):
        if block_n != plan.block_n:
            wide = dataclasses.replace(plan, block_n=block_n, num_warps=max(4, block_n // 8))
            variants[f"fused_{wide.name}"] = wide
    if plan.num_stages > 1:
        flat = dataclasses.replace(plan, num_stages=1)
        variants[f"fused_{flat.name}"] = flat
    return variants


def implementations(x, res, norm_w, weights, silu: bool, offset: float, plan) -> dict:
    """name -> launch(i) on weight copy i."""
    gemv = gemv_silu_and_mul_triton if silu else gemv_triton

    def two_launches(i):
        normed, new_res = rms_norm_triton(x, norm_w, EPS, res, offset)
        return gemv(normed, weights[i]), new_res

    def fused_with(fused_plan):
        def fused(i):
            y, new_res, _ = rms_norm_gemv_triton(
                x, res, norm_w, EPS, weights[i], weight_offset=offset, silu_and_mul=silu,
                plan=fused_plan,
            )  # fmt: skip
            return y, new_res

        return fused

    launches = {"norm+gemv": two_launches, "fused": fused_with(None)}
    for name, variant in fused_plan_variants(plan).items():
        launches[name] = fused_with(variant)
    return launches


def conv_implementations(x, res, norm_w, weights, offset, conv_w, pool, slots) -> dict:
    """name -> launch(i) on weight copy i: the GDN in_proj with its decode conv update."""
    channels = conv_w.shape[0]

    def two_launches(i):
        y, new_res, _ = rms_norm_gemv_triton(x, res, norm_w, EPS, weights[i], weight_offset=offset)
        conv = causal_conv1d_update_triton(y[:, :channels], conv_w, None, pool, slots)
        return y, new_res, conv

    def fused(i):
        return rms_norm_gemv_conv_triton(
            x, res, norm_w, EPS, weights[i], None, conv_w, pool, slots, weight_offset=offset
        )

    return {"conv:two_launches": two_launches, "conv:fused": fused}


def conv_same_bits(launches: dict, pool: torch.Tensor) -> bool:
    """conv:fused against conv:two_launches from one pool state (restored after)."""
    start = pool.clone()
    want = launches["conv:two_launches"](0)
    want_pool = pool.clone()
    pool.copy_(start)
    got = launches["conv:fused"](0)
    same = all(torch.equal(a, b) for a, b in zip(got, want)) and torch.equal(pool, want_pool)
    pool.copy_(start)
    return same


def bench_conv(name, x, res, norm_w, weights, offset, channels, copies, gen, timer, log):
    """Rows for the in_proj + conv update: two launches against the fused one."""
    m, k = x.shape
    n, device = weights[0].shape[0], x.device
    conv_w = (torch.randn(channels, CONV_WIDTH, generator=gen, device=device) * 0.5).to(x.dtype)
    pool = torch.randn(m, channels, CONV_WIDTH - 1, generator=gen, device=device)
    slots = torch.arange(m, dtype=torch.int32, device=device)
    launches = conv_implementations(x, res, norm_w, weights, offset, conv_w, pool, slots)
    same = conv_same_bits(launches, pool)
    times = {impl: timer(launch, copies) for impl, launch in launches.items()}
    rows = []
    for impl, us in times.items():
        row = dict(shape=name, k=k, n=n, silu=False, m=m, impl=impl, us=us)
        row.update(GBps=gbps(n * k * 2, us), conv_channels=channels)
        if impl == "conv:fused":
            base = times["conv:two_launches"]
            row.update(same_bits_as_two_launches=same, speedup_vs_two_launches=base / us)
            row["saved_us"] = base - us
        rows.append(row)
        log(f"RESULT {name} k={k} n={n} m={m} impl={impl} us={us:.2f}")
    fused = rows[-1]
    flag = "" if same else " WARN"
    log(
        f"FUSION_CONV {name} m={m} speedup_vs_two_launches={fused['speedup_vs_two_launches']:.3f}"
        f" saved_us={fused['saved_us']:.2f} same_bits={same}{flag}"
    )
    return rows


def bench_shape(name, k, n, silu, offset, conv, batches, device, timer, log) -> list[dict]:
    dtype = torch.bfloat16
    weight_bytes = n * k * 2
    copies = weight_copies(weight_bytes) if device.type == "cuda" else 1
    gen = torch.Generator(device=device).manual_seed(k * 7919 + n)
    weights = [
        (torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(dtype) for _ in range(copies)
    ]
    norm_w = (torch.randn(k, generator=gen, device=device) * 0.3 + 1 - offset).to(dtype)
    rows = []
    for m in batches:
        x = torch.randn(m, k, generator=gen, device=device).to(dtype)
        res = torch.randn(m, k, generator=gen, device=device).to(dtype)
        plan = choose_gemv_plan(m, n, k, dtype)
        launches = implementations(x, res, norm_w, weights, silu, offset, plan)
        plain_out = launches["norm+gemv"](0)
        times = {impl: timer(launch, copies) for impl, launch in launches.items()}
        for impl, us in times.items():
            row = dict(shape=name, k=k, n=n, silu=silu, m=m, impl=impl, us=us)
            row["GBps"] = gbps(weight_bytes, us)
            if impl.startswith("fused"):
                same = all(torch.equal(a, b) for a, b in zip(launches[impl](0), plain_out))
                row.update(
                    plan=impl[len("fused_") :] or plan.name,
                    same_bits_as_two_launches=same,
                    speedup_vs_two_launches=times["norm+gemv"] / us,
                    saved_us=times["norm+gemv"] - us,
                )
            rows.append(row)
            log(f"RESULT {name} k={k} n={n} m={m} impl={impl} us={us:.2f} GBps={row['GBps']:.0f}")
        fused_rows = [r for r in rows[-len(times) :] if r["impl"].startswith("fused")]
        same_bits = all(r["same_bits_as_two_launches"] for r in fused_rows)
        best = min(fused_rows, key=lambda r: r["us"])
        flag = "" if same_bits else " WARN"
        log(
            f"FUSION {name} m={m} chosen_plan={plan.name} "
            f"speedup_vs_two_launches={times['norm+gemv'] / times['fused']:.3f} "
            f"saved_us={times['norm+gemv'] - times['fused']:.2f} best={best['plan']} "
            f"best_saved_us={best['saved_us']:.2f} same_bits={same_bits}{flag}"
        )
        if conv:
            rows += bench_conv(name, x, res, norm_w, weights, offset, conv, copies, gen, timer, log)
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
    shapes = TINY_SHAPES if args.tiny else SHAPES
    timer = time_graph_us if device.type == "cuda" else time_wall_us
    rows: list[dict] = []
    for shape in shapes:
        rows += bench_shape(*shape, BATCHES, device, timer, print)
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
