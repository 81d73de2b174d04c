"""Route-block plan table of the quantized fused-MoE kernels (seed 003's layout: tokens x
route block size, ms per launch), plus decode GEMMs of the quantized linears.

    python3 benchmarks/quant_moe_plans.py --out $OUT/quant_moe_plans.json

MoE at Qwen3-Next's shape by default (E=512, top-10, H=2048, I=512, one rank): for
each scheme (w4a16 g32, fp8 128-blocks), tokens in TOKENS and each route block (16, 32,
64), the median ms of REPEATS launches (CUDA events), the block `choose_block_m` picks,
and whether every plan's output is bitwise the first's (invariant 7). Each row also has
the weight bytes the launch must read (the experts its routes touch) over the measured
HBM bandwidth of a device copy: the bandwidth floor. Linear: Qwen3-8B's projections at
1, 256 and 4096 tokens (TFLOP/s for the prefill size), FP8 and W4A16 beside bf16
F.linear.

`--gemv` adds the decode GEMVs (kernels/quant_gemv_triton.py) at 1 and 8 tokens: bf16
F.linear and the bf16 GEMV beside the FP8 / W4A16 GEMMs and GEMVs (the default plan and a
few candidate tilings, with whether they agree bitwise), each timed as gemv_plans.py
does: inside a CUDA graph over rotating weight copies, so every launch reads its weight
from HBM (us per launch). `--no-moe` skips the MoE table.

`--fp8-plans` adds the FP8 GEMM plan table (kernels/fp8_gemm_triton.py, issue 22): at
Qwen3-8B's projections and FP8_PLAN_TOKENS, ms and TFLOP/s of the GEMM alone (activations
quantized beforehand; their quantization is timed apart) in every plan of
FP8_GEMM_PLANS, beside bf16 F.linear; the plan `choose_fp8_gemm_plan` picks; whether
every plan's output is bitwise the first's (invariant 7); and torch._scaled_mm with
blockwise scales (1x128 activations, 128x128 weights) as a reference row where the
running torch and GPU accept it (a failure is recorded, not raised). It also times the
prefill plan with max_num_imprecise_acc=32 (FP8 wgmma instead of fp16 mma.sync) and
gives its and the default's largest error against a float64 product. Each row also
times the serving path: `ops.fp8_linear` as a block-scaled layer calls it (activation
quantization included), with the kernel it took (`serving_path_kernel`: gemv, triton,
scaled_mm, or reference off CUDA; kernels/fp8_gemm_dispatch.py) and why not cuBLAS
where it did not, beside the Triton linear alone (`ms_triton_linear`, quantization
included).

    python3 benchmarks/quant_moe_plans.py --no-moe --fp8-plans --out $OUT/fp8_plans.json

`--act-quant` adds the FP8 activation quantizer table (issue 22): at ACT_QUANT_TOKENS x
ACT_QUANT_WIDTHS (128-column groups, bf16 in), us per launch inside a CUDA graph (inputs
rotated as gemv_plans.py rotates weights, up to one copy per launch of the graph: from
512 tokens on each launch reads HBM, smaller inputs partly L2) of the pre-issue-22 path (`baseline_quant`: the
chunked kernel, one program per group) and of the tiled quantizer in its chosen plan
(row-major scales, and column-major as cuBLAS reads them) and in each of
ACT_QUANT_CANDIDATES; the bytes' floor at the measured bandwidth; and whether the new
path's bits (both layouts, every plan) equal the baseline's. `--no-linear` skips the
linear table.

    python3 benchmarks/quant_moe_plans.py --no-moe --no-linear --act-quant \
        --out $OUT/act_quant.json

`--tiny` runs small shapes, also on a CPU under TRITON_INTERPRET=1 (only to exercise the
script: timings there mean nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from kvloom.kernels.fp8_moe_triton import choose_fp8_block_m
from kvloom.kernels.fused_moe_triton import choose_block_m
from kvloom.kernels.gemv_triton import GemvPlan
from kvloom.kernels.w4a16_gemm import pack_int4

sys.path.insert(0, str(Path(__file__).parent))
from gemv_plans import (  # noqa: E402
    LAUNCHES_PER_GRAPH,
    time_graph_us,
    time_wall_us,
    weight_copies,
)

TOKENS = (1, 16, 64, 128, 512, 1024, 1536)
PLANS = (16, 32, 64)
CHOOSE = {"w4a16_g32": choose_block_m, "fp8_block128": choose_fp8_block_m}  # each scheme's plan
LINEAR_TOKENS = (1, 256, 4096)  # decode, a decode batch, a prefill chunk
LINEAR_SHAPES = ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))  # (N, K)
FP8_PLAN_TOKENS = (1, 16, 256, 1024, 4096)
GEMV_TOKENS = (1, 8)
ACT_QUANT_TOKENS = (1, 64, 512, 4096)
ACT_QUANT_WIDTHS = (2048, 4096, 12288)
# (tokens, groups, warps) tiles timed beside the chosen plan (QuantPlan).
ACT_QUANT_CANDIDATES = ((1, 8, 4), (1, 16, 4), (1, 32, 8), (2, 32, 16), (8, 4, 8), (8, 8, 8))
# Tilings tried beside each format's default plan (all split_k 1, the default's at these
# shapes): block_n, block_k (columns per step), warps, pipeline stages.
GEMV_CANDIDATES = {
    "fp8": (GemvPlan(16, 256, 4, 4), GemvPlan(32, 256, 4, 4), GemvPlan(16, 128, 2, 6),
            GemvPlan(32, 512, 8, 3)),
    "int4": (GemvPlan(16, 512, 4, 4), GemvPlan(32, 512, 4, 3), GemvPlan(16, 256, 2, 6),
             GemvPlan(64, 512, 8, 3)),
}  # fmt: skip


def timed(fn, repeats: int) -> float:
    """Median ms of `repeats` calls (after one warm-up, which also compiles)."""
    fn()
    if not torch.cuda.is_available():
        return float("nan")
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def hbm_gbps(device) -> float:
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), 10)
    return 2 * src.numel() / ms / 1e6  # read + write, GB/s


def moe_weights(scheme, e, h, i, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    if scheme == "w4a16_g32":
        w13 = pack_int4(torch.randint(-8, 8, (e, 2 * i, h), generator=g, dtype=torch.int8))
        w2 = pack_int4(torch.randint(-8, 8, (e, h, i), generator=g, dtype=torch.int8))
        s13 = torch.rand(e, 2 * i, h // 32, generator=g) * 0.02
        s2 = torch.rand(e, h, i // 32, generator=g) * 0.02
        tensors = [w13, s13.bfloat16(), w2, s2.bfloat16()]
    else:
        w13 = (torch.randn(e, 2 * i, h, generator=g) * 20).to(torch.float8_e4m3fn)
        w2 = (torch.randn(e, h, i, generator=g) * 20).to(torch.float8_e4m3fn)
        tensors = [
            w13,
            torch.rand(e, 2 * i, h // 128) * 0.002,
            w2,
            torch.rand(e, h, i // 128) * 0.002,
        ]
    return [t.to(device) for t in tensors]


def moe_call(scheme, x, weights, topw, ids):
    """block_m -> one fused-MoE launch's output."""
    from kvloom.kernels.fp8_moe_triton import fp8_fused_moe_triton
    from kvloom.kernels.w4a16_moe_triton import w4a16_fused_moe_triton

    if scheme == "w4a16_g32":
        return lambda b: w4a16_fused_moe_triton(x, *weights, 32, topw, ids, block_m=b)
    w13, s13, w2, s2 = weights
    return lambda b: fp8_fused_moe_triton(x, w13, s13, w2, s2, 128, 128, topw, ids, block_m=b)


def moe_rows(args, device, gbps):
    e, k, h, i = args.experts, args.top_k, args.hidden, args.inter
    rows = []
    for scheme in ("w4a16_g32", "fp8_block128"):
        weights = moe_weights(scheme, e, h, i, device)
        per_expert_bytes = sum(w[0].numel() * w.element_size() for w in weights)
        for tokens in args.tokens:
            g = torch.Generator(device="cpu").manual_seed(tokens)
            x = torch.randn(tokens, h, generator=g).to(device, torch.bfloat16)
            ids = torch.rand(tokens, e, generator=g).argsort(dim=1)[:, :k].to(device, torch.int32)
            topw = torch.full((tokens, k), 1.0 / k, device=device)
            call = moe_call(scheme, x, weights, topw, ids)
            outs = {b: call(b) for b in PLANS}
            bitwise = all(torch.equal(outs[b], outs[PLANS[0]]) for b in PLANS)
            touched = int(torch.unique(ids).numel())
            floor_ms = touched * per_expert_bytes / gbps / 1e6
            row = {"scheme": scheme, "tokens": tokens, "chosen_block_m": CHOOSE[scheme](tokens, k, e),
                   "bitwise_across_plans": bitwise, "bandwidth_floor_ms": floor_ms}  # fmt: skip
            for b in PLANS:
                row[f"ms_block_{b}"] = timed(partial(call, b), args.repeats)
            rows.append(row)
            print(json.dumps(row))
    return rows


def linear_rows(args, device, gbps):
    from kvloom.kernels.fp8_gemm_triton import fp8_linear_triton
    from kvloom.kernels.w4a16_gemm_triton import w4a16_linear_triton

    rows = []
    for n, k in args.linear_shapes:
        g = torch.Generator(device="cpu").manual_seed(n + k)
        w_bf16 = (torch.randn(n, k, generator=g) * 0.02).to(device, torch.bfloat16)
        w8 = (torch.randn(n, k, generator=g) * 20).to(torch.float8_e4m3fn).to(device)
        s8 = (torch.rand(n, k // 128, generator=g) * 0.002).to(device)
        w4 = pack_int4(torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)).to(device)
        s4 = (torch.rand(n, k // 128, generator=g) * 0.002).to(device, torch.bfloat16)
        for tokens in args.linear_tokens:
            x = torch.randn(tokens, k, generator=g).to(device, torch.bfloat16)
            row = {"N": n, "K": k, "tokens": tokens}
            row["ms_bf16_linear"] = timed(partial(F.linear, x, w_bf16), args.repeats)
            row["ms_fp8"] = timed(partial(fp8_linear_triton, x, w8, s8, 128), args.repeats)
            row["ms_w4a16"] = timed(partial(w4a16_linear_triton, x, w4, s4, 128), args.repeats)
            for name in ("bf16_linear", "fp8", "w4a16"):  # the prefill sizes' figure
                row[f"tflops_{name}"] = 2 * n * k * tokens / row[f"ms_{name}"] / 1e9
            row["floor_ms_fp8"] = (w8.numel() + s8.numel() * 4) / gbps / 1e6
            row["floor_ms_w4a16"] = (w4.numel() * 4 + s4.numel() * 2) / gbps / 1e6
            rows.append(row)
            print(json.dumps(row))
    return rows


def scaled_mm_reference(row, x_q, x_s, w8, s_blocks, first, repeats):
    """torch._scaled_mm with 1x128 activation and 128x128 weight scales, where the
    running torch and GPU accept them: ms, TFLOP/s and its largest difference from the
    first plan's output (relative to that output's scale); else the error."""
    a_scale = x_s.t().contiguous().t()  # 1x128 blocks: scales outer-dimension-major
    call = partial(torch._scaled_mm, x_q, w8.t(), a_scale, s_blocks.t(), out_dtype=first.dtype)
    try:
        out = call()
        row["ms_scaled_mm"] = timed(call, repeats)
    except Exception as exc:  # recorded: the row says why it has no time
        row["scaled_mm_error"] = f"{type(exc).__name__}: {exc}"[:600]
        return
    row["tflops_scaled_mm"] = (
        2 * x_q.shape[0] * w8.shape[0] * w8.shape[1] / row["ms_scaled_mm"] / 1e9
    )
    scale = max(first.abs().max().item(), 1e-30)
    row["scaled_mm_max_diff_rel"] = (out.float() - first.float()).abs().max().item() / scale


def imprecise_acc_candidate(row, gemm, x_q, x_s, w8, s8, flop, repeats):
    """The prefill plan with max_num_imprecise_acc=32 (FP8 wgmma, each 32-product MMA
    added into float32): its time, and both its and the default's largest error (float32
    outputs) against a float64 product, relative to the output's largest magnitude."""
    from kvloom.kernels.fp8_gemm_triton import PREFILL_PLAN, fp8_matmul_triton

    exact = fp8_exact(x_q, x_s, w8, s8)
    scale = max(exact.abs().max().item(), 1e-30)
    f32 = partial(fp8_matmul_triton, x_q, x_s, w8, s8, 128, None, torch.float32)
    for acc in (0, 32):
        name = "default" if acc == 0 else "imprecise32"
        try:
            out = f32(plan=PREFILL_PLAN, imprecise_acc=acc)
        except Exception as exc:  # recorded: the row says why it has no figures
            row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:600]
            return
        row[f"max_err_rel_{name}"] = (out.double() - exact).abs().max().item() / scale
    row["ms_imprecise32"] = timed(partial(gemm, plan=PREFILL_PLAN, imprecise_acc=32), repeats)
    row["tflops_imprecise32"] = flop / row["ms_imprecise32"] / 1e9


def serving_path(row, x, w8, s8, s_blocks, flop, repeats):
    """ops.fp8_linear with the layer's block scale, as Fp8Method.apply calls it: ms and
    TFLOP/s, the kernel it took and why not cuBLAS; and the Triton linear beside it."""
    from kvloom.kernels import dispatch, fp8_gemm_dispatch, ops
    from kvloom.kernels.fp8_gemm_triton import fp8_linear_triton
    from kvloom.kernels.quant_gemv import QUANT_GEMV_MAX_M

    tokens = x.shape[0]
    call = partial(ops.fp8_linear, x, w8, s8, 128, block_scale=s_blocks)
    call()  # a refusal is remembered on the first call
    blocker = fp8_gemm_dispatch.scaled_mm_blocker(x, w8, 128, s_blocks)
    if not dispatch.use_triton(x):
        kernel = "reference"
    elif tokens <= QUANT_GEMV_MAX_M:
        kernel = "gemv"
    else:
        kernel = "triton" if blocker else "scaled_mm"
    row["serving_path_kernel"], row["serving_path_not_scaled_mm"] = kernel, blocker
    row["ms_serving_path"] = timed(call, repeats)
    row["tflops_serving_path"] = flop / row["ms_serving_path"] / 1e9
    row["ms_triton_linear"] = timed(partial(fp8_linear_triton, x, w8, s8, 128), repeats)
    row["tflops_triton_linear"] = flop / row["ms_triton_linear"] / 1e9


def fp8_exact(x_q, x_s, w8, s8):
    """The FP8 GEMM's output in float64 (groups of 128 columns)."""
    out = torch.zeros(x_q.shape[0], w8.shape[0], dtype=torch.float64, device=x_q.device)
    for g in range(x_s.shape[1]):
        cols = slice(g * 128, (g + 1) * 128)
        part = x_q[:, cols].double() @ w8[:, cols].double().T
        out += part * x_s[:, g, None].double() * s8[None, :, g].double()
    return out


def fp8_plan_rows(args, device):
    """Every FP8 GEMM plan at each shape and token count (the GEMM alone, 128x128 weight
    blocks expanded to per-row scales as the loader does)."""
    from kvloom.kernels.fp8_gemm_triton import (
        FP8_GEMM_PLANS,
        choose_fp8_gemm_plan,
        fp8_matmul_triton,
        per_token_group_quant_fp8_triton,
    )

    rows = []
    for n, k in args.fp8_shapes:
        g = torch.Generator(device="cpu").manual_seed(n + k)
        w_bf16 = (torch.randn(n, k, generator=g) * 0.02).to(device, torch.bfloat16)
        w8 = (torch.randn(n, k, generator=g) * 20).to(torch.float8_e4m3fn).to(device)
        s_blocks = (torch.rand(n // 128, k // 128, generator=g) * 0.002).to(device)
        s8 = s_blocks.repeat_interleave(128, dim=0).contiguous()
        for tokens in args.fp8_tokens:
            x = torch.randn(tokens, k, generator=g).to(device, torch.bfloat16)
            x_q, x_s = per_token_group_quant_fp8_triton(x, 128)
            flop = 2 * n * k * tokens
            row = {
                "N": n,
                "K": k,
                "tokens": tokens,
                "chosen_plan": choose_fp8_gemm_plan(tokens).name,
            }
            row["ms_bf16_linear"] = timed(partial(F.linear, x, w_bf16), args.repeats)
            row["tflops_bf16_linear"] = flop / row["ms_bf16_linear"] / 1e9
            row["ms_quant_activations"] = timed(
                partial(per_token_group_quant_fp8_triton, x, 128), args.repeats
            )
            gemm = partial(fp8_matmul_triton, x_q, x_s, w8, s8, 128, None, torch.bfloat16)
            calls = {p.name: partial(gemm, plan=p) for p in FP8_GEMM_PLANS}
            outs = {name: call() for name, call in calls.items()}
            first = outs[FP8_GEMM_PLANS[0].name]
            row["plans_differing_from_first"] = [
                m for m, o in outs.items() if not torch.equal(o, first)
            ]
            row["bitwise_across_plans"] = not row["plans_differing_from_first"]
            del outs
            row["ms_plans"] = {name: timed(call, args.repeats) for name, call in calls.items()}
            row["tflops_plans"] = {name: flop / ms / 1e9 for name, ms in row["ms_plans"].items()}
            row["ms_chosen"] = row["ms_plans"][row["chosen_plan"]]
            row["best_plan"] = min(row["ms_plans"], key=row["ms_plans"].get)
            imprecise_acc_candidate(row, gemm, x_q, x_s, w8, s8, flop, args.repeats)
            scaled_mm_reference(row, x_q, x_s, w8, s_blocks, first, args.repeats)
            serving_path(row, x, w8, s8, s_blocks, flop, args.repeats)
            rows.append(row)
            print(json.dumps(row))
    return rows


def gemv_weights(n, k, device):
    """bf16, FP8 (128-blocks) and int4 (g128) weights of one [n, k] linear."""
    g = torch.Generator(device="cpu").manual_seed(n * k)
    return {
        "bf16": ((torch.randn(n, k, generator=g) * 0.02).to(device, torch.bfloat16),),
        "fp8": (
            (torch.randn(n, k, generator=g) * 20).to(torch.float8_e4m3fn).to(device),
            (torch.rand(n, k // 128, generator=g) * 0.002).to(device),
        ),
        "int4": (
            pack_int4(torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)).to(device),
            (torch.rand(n, k // 128, generator=g) * 0.002).to(device, torch.bfloat16),
        ),
    }


def quant_call(kernel, x, **kw):
    """(weight, scale) -> kernel(x, weight, scale, 128, **kw): 128-column groups."""
    return lambda w, scale: kernel(x, w, scale, 128, **kw)


def time_over(timer, call, copies) -> float:
    """us per `call(*weights)`, rotating over the copies of the weights."""
    return timer(lambda i: call(*copies[i]), len(copies))


def gemv_rows(args, device, gbps):
    """us per launch at GEMV_TOKENS of every path a decode-size linear can take."""
    from kvloom.kernels.fp8_gemm_triton import fp8_linear_triton
    from kvloom.kernels.gemv_triton import gemv_triton
    from kvloom.kernels.quant_gemv_triton import (
        choose_quant_gemv_plan,
        fp8_gemv_triton,
        w4a16_gemv_triton,
    )
    from kvloom.kernels.w4a16_gemm_triton import w4a16_linear_triton

    timer = time_graph_us if device.type == "cuda" else time_wall_us
    gemm = {"fp8": fp8_linear_triton, "int4": w4a16_linear_triton}
    gemv = {"fp8": fp8_gemv_triton, "int4": w4a16_gemv_triton}
    rows = []
    for n, k in args.linear_shapes:
        one = gemv_weights(n, k, device)
        nbytes = {f: sum(t.numel() * t.element_size() for t in ts) for f, ts in one.items()}
        # rotating copies: a copy is re-read only after > 100 MiB of others (L2 is 50 MiB)
        copies = {f: [one[f]] + [tuple(t.clone() for t in one[f])
                                 for _ in range(weight_copies(nbytes[f]) - 1)]
                  for f in one}  # fmt: skip
        del one
        for tokens in GEMV_TOKENS:
            g = torch.Generator(device="cpu").manual_seed(tokens)
            x = torch.randn(tokens, k, generator=g).to(device, torch.bfloat16)
            wb = copies["bf16"]
            row = {"N": n, "K": k, "tokens": tokens, "bf16_floor_us": nbytes["bf16"] / gbps / 1e3}
            row["us_bf16_linear"] = time_over(timer, partial(F.linear, x), wb)
            row["us_bf16_gemv"] = time_over(timer, partial(gemv_triton, x), wb)
            for fmt in ("fp8", "int4"):
                ws = copies[fmt]
                row[f"{fmt}_floor_us"] = nbytes[fmt] / gbps / 1e3
                row[f"us_{fmt}_gemm"] = time_over(timer, quant_call(gemm[fmt], x), ws)
                default = choose_quant_gemv_plan(tokens, n, k, fmt)
                row[f"{fmt}_gemv_default_plan"] = default.name
                first = quant_call(gemv[fmt], x, plan=default)(*ws[0])
                times, bitwise = {}, True
                for plan in (default, *GEMV_CANDIDATES[fmt]):
                    call = quant_call(gemv[fmt], x, plan=plan)
                    if plan.split_k == default.split_k:
                        bitwise &= torch.equal(call(*ws[0]), first)
                    times[plan.name] = time_over(timer, call, ws)
                row[f"us_{fmt}_gemv"] = times[default.name]
                row[f"us_{fmt}_gemv_plans"] = times
                row[f"{fmt}_gemv_best_plan"] = min(times, key=times.get)
                row[f"{fmt}_gemv_bitwise_across_plans"] = bitwise
            rows.append(row)
            print(json.dumps(row))
        del copies
    return rows


def baseline_quant(x: torch.Tensor, group: int, column_major: bool = False):
    """Baseline (benchmark only): the quantizer as it was before issue 22, every group
    through the chunked kernel, one 128-element program per (token, group)."""
    from kvloom.kernels.fp8_gemm_triton import _launch_quant_wide_groups

    t, k = x.shape
    x_q = torch.empty((t, k), dtype=torch.float8_e4m3fn, device=x.device)
    if column_major:
        x_s = torch.empty((k // group, t), dtype=torch.float32, device=x.device).t()
    else:
        x_s = torch.empty((t, k // group), dtype=torch.float32, device=x.device)
    _launch_quant_wide_groups(x, x_q, x_s, group)
    return x_q, x_s


def same_bits(a, b) -> bool:
    """Quantized values (as bytes) and scales bitwise equal, strides included."""
    return (
        torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))
        and torch.equal(a[1], b[1])
        and a[1].stride() == b[1].stride()
    )


def act_quant_row(tokens, k, device, gbps):
    """One (tokens, K) row of the --act-quant table (module docstring)."""
    from kvloom.kernels.fp8_gemm_triton import (
        QuantPlan,
        choose_quant_plan,
        per_token_group_quant_fp8_triton,
    )

    timer = time_graph_us if device.type == "cuda" else time_wall_us
    group = 128
    nbytes = tokens * k * 3 + tokens * (k // group) * 4  # bf16 in, e4m3 + scales out
    # Rotated inputs (a graph replays LAUNCHES_PER_GRAPH launches, so no more copies).
    copies = min(weight_copies(tokens * k * 2), LAUNCHES_PER_GRAPH) if device.type == "cuda" else 1
    g = torch.Generator(device="cpu").manual_seed(tokens + k)
    xs = [torch.randn(tokens, k, generator=g).mul(3).to(device, torch.bfloat16)
          for _ in range(copies)]  # fmt: skip
    plans = {p.name: p for p in (QuantPlan(*c) for c in ACT_QUANT_CANDIDATES)}
    row = {"tokens": tokens, "K": k, "group": group, "bytes": nbytes,
           "floor_us": nbytes / gbps / 1e3}  # fmt: skip
    bitwise = True
    for cm, tag in ((False, ""), (True, "_column_major")):
        row[f"chosen_plan{tag}"] = choose_quant_plan(tokens, group, k // group, cm).name
        old = baseline_quant(xs[0], group, cm)
        for plan in (None, *plans.values()):
            bitwise &= same_bits(old, per_token_group_quant_fp8_triton(xs[0], group, cm, plan=plan))
        new = partial(per_token_group_quant_fp8_triton, group_size=group, column_major_scales=cm)
        row[f"us_old{tag}"] = timer(lambda i, cm=cm: baseline_quant(xs[i], group, cm), copies)
        row[f"us_new{tag}"] = timer(lambda i, new=new: new(xs[i]), copies)
        row[f"speedup{tag}"] = row[f"us_old{tag}"] / row[f"us_new{tag}"]
    row["bitwise_new_equals_old"] = bitwise
    row["new_vs_floor"] = row["us_new"] / row["floor_us"]
    row["us_plans"] = {
        name: timer(lambda i, p=p: per_token_group_quant_fp8_triton(xs[i], group, plan=p), copies)
        for name, p in plans.items()
    }
    row["best_plan"] = min(row["us_plans"], key=row["us_plans"].get)
    return row


def act_quant_rows(args, device, gbps):
    """us per quantizer launch, old path vs new (module docstring, --act-quant)."""
    rows = []
    for k in args.act_quant_widths:
        for tokens in args.act_quant_tokens:
            rows.append(act_quant_row(tokens, k, device, gbps))
            print(json.dumps(rows[-1]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--gemv", action="store_true", help="add the decode GEMV rows")
    parser.add_argument("--no-moe", action="store_true", help="skip the MoE table")
    parser.add_argument("--fp8-plans", action="store_true", help="add the FP8 GEMM plan table")
    parser.add_argument("--act-quant", action="store_true", help="add the FP8 quantizer table")
    parser.add_argument("--no-linear", action="store_true", help="skip the linear table")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.tiny:
        args.experts, args.top_k, args.hidden, args.inter = 4, 2, 128, 128
        args.tokens, args.linear_shapes, args.repeats = (1, 9), ((64, 128),), 1
        args.linear_tokens = (1, 3)
        args.fp8_shapes, args.fp8_tokens = ((256, 256),), (1, 130)
        args.act_quant_tokens, args.act_quant_widths = (1, 9), (256, 384)
    else:
        args.experts, args.top_k, args.hidden, args.inter = 512, 10, 2048, 512
        args.tokens, args.linear_shapes = TOKENS, LINEAR_SHAPES
        args.linear_tokens = LINEAR_TOKENS
        args.fp8_shapes, args.fp8_tokens = LINEAR_SHAPES, FP8_PLAN_TOKENS
        args.act_quant_tokens, args.act_quant_widths = ACT_QUANT_TOKENS, ACT_QUANT_WIDTHS
    gbps = hbm_gbps(device)
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "hbm_gbps_measured": gbps,
        "moe_shape": {"E": args.experts, "top_k": args.top_k, "H": args.hidden, "I": args.inter},
        "moe": [] if args.no_moe else moe_rows(args, device, gbps),
        "linear": [] if args.no_linear else linear_rows(args, device, gbps),
    }
    if args.gemv:
        result["gemv"] = gemv_rows(args, device, gbps)
    if args.fp8_plans:
        result["fp8_plans"] = fp8_plan_rows(args, device)
    if args.act_quant:
        result["act_quant"] = act_quant_rows(args, device, gbps)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
