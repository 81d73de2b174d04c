"""Times the paged-attention Triton kernel's tilings on the shapes the benchmarks hit, so a
plan change is chosen by measurement (issue 7's next step), in one device call:

- prefill: rows of 128–1024 fresh tokens (the offline workload's prompts), Qwen3-8B heads
  (32 query / 8 KV, head 128, bf16): TFLOP/s of each candidate long-row plan;
- decode at batch 1 and 8 with 128–4096 keys: µs per launch, one pass against split-KV;
- the batch-invariant split-KV decode the serving path runs for decode steps
  (`paged_attention_decode_split_triton`, fixed-size key splits) beside the one-pass
  kernel, at batch 1/8/64/256 x context 128/640/4096, for split sizes of 128, 256 (the
  plan constant) and 512 keys, its grid sized from the real lengths and from a CUDA
  graph's bound (`--graph-bound`, max_model_len), and with its merge done in the attention
  launch (`split_merge`, "_merged"). Each is timed inside a CUDA graph of
  `--repeats` launches (no host overhead; CUDA events), as the decode graphs run it.

    python benchmarks/attention_plans.py --out $OUT/attention_plans.json
    python benchmarks/attention_plans.py --split-decode-only --out $OUT/split_decode.json
    python benchmarks/attention_plans.py --split-decode-only --heads 16 2 256 \
        --batch 1 8 --split-keys 64 128 256 --out $OUT/split_decode_qwen3_next.json

`--heads` sets the query heads, KV heads and head size (Qwen3-8B's by default). With
Qwen3-Next's two KV heads of 256 dims, a 256-key split gives a batch-1 row at 128-640 keys
2-6 programs (its 4 attention launches took 12.5 us each in an H100's batch-1 timeline,
twenty-first session): the split size to try there is smaller.

Each variant is checked against the default plan's output first (the same function must
be computed); `--tiny` runs small shapes (also under TRITON_INTERPRET=1 on a CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path

if "--tiny" in sys.argv:  # the interpreter is chosen when triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import graph_timing  # noqa: E402

from kvloom.kernels import paged_attention_triton as pa  # noqa: E402
from kvloom.kernels.paged_attention_triton import (  # noqa: E402
    DECODE_KEYS_PER_SPLIT,
    decode_split_slots,
    paged_attention_decode_split_triton,
    paged_attention_triton,
)

LONG_PLANS = {
    "default": None,
    "m64_t64_w4_s2": dict(BLOCK_M=64, TILE=64, num_warps=4, num_stages=2),
    "m128_t32_w8_s2": dict(BLOCK_M=128, TILE=32, num_warps=8, num_stages=2),
    "m128_t64_w8_s2": dict(BLOCK_M=128, TILE=64, num_warps=8, num_stages=2),
    "m128_t64_w8_s3": dict(BLOCK_M=128, TILE=64, num_warps=8, num_stages=3),
}


def make_batch(lengths, num_kv_heads, head_dim, block_size, dtype, device, decode: bool):
    """A paged cache holding `lengths` keys per row; queries: the whole row (prefill) or
    its last token (decode)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    pages = [-(-n // block_size) for n in lengths]
    num_blocks = sum(pages) + 1
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    kv = kv.to(device=device, dtype=dtype)
    width = max(pages)
    table, next_block = [], 1
    for p in pages:
        table.append(list(range(next_block, next_block + p)) + [0] * (width - p))
        next_block += p
    q_lens = [1 if decode else n for n in lengths]
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)

    def tensor(values, dt=torch.int32):
        return torch.tensor(values, dtype=dt, device=device)

    return kv, tensor(table), tensor(qsl), tensor(lengths), sum(q_lens)


def time_ms(fn, repeat: int) -> float:
    if not torch.cuda.is_available():
        fn()
        return float("nan")
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def graph_time_us(fn, repeats: int) -> float:
    """µs per call in a CUDA graph (graph_timing.py); on the CPU (--tiny): one call, NaN."""
    if not torch.cuda.is_available():
        fn()
        return float("nan")
    return graph_timing.graph_time_us(fn, repeats)


def with_short_plan(plan: str, fn):
    """fn run under another short-row (decode) plan: "tTILE_wWARPS_sSTAGES", e.g. t128_w4_s2."""
    tile, warps, stages = (int(part[1:]) for part in plan.split("_"))
    real = pa._plans

    def plans(*args):
        short, long = real(*args)
        return {**short, "TILE": tile, "num_warps": warps, "num_stages": stages}, long

    def run():
        pa._plans, split_plan, pa.DECODE_SPLIT_PLAN = plans, pa.DECODE_SPLIT_PLAN, None
        try:
            return fn()
        finally:
            pa._plans, pa.DECODE_SPLIT_PLAN = real, split_plan

    return run


def split_decode_cases(args, device, dtype, shape, results) -> None:
    """The fixed-keys split decode beside the one-pass kernel, µs per launch in graphs."""
    hq, hkv, dim, block = shape
    batches, contexts = ([1, 3], [40, 100]) if args.tiny else (args.batch, args.context)
    key_sizes = [64] if args.tiny else args.split_keys
    for batch in batches:
        for keys in contexts:
            kv, table, qsl, lens, tokens = make_batch(
                [keys] * batch, hkv, dim, block, dtype, device, True
            )
            # A graph's block table: as wide as max_model_len (the split slots follow it).
            width = -(-args.graph_bound // block) + 1
            wide = torch.zeros(batch, width, dtype=table.dtype, device=device)
            wide[:, : table.shape[1]] = table
            q = torch.randn(tokens, hq, dim, device=device).to(dtype)
            out = torch.empty_like(q)
            lse = torch.empty(tokens, hq, device=device)
            base, _ = paged_attention_triton(q, kv, wide, qsl, lens, dim**-0.5, max_query_len=1)

            args_ = (q, kv, wide, qsl, lens, dim**-0.5)
            one_pass = partial(paged_attention_triton, *args_, max_query_len=1, out=out, lse=lse)
            kv_bytes = 2 * batch * keys * hkv * dim * kv.element_size()
            variants = {"one_pass": one_pass}
            for split_keys in key_sizes:
                slots = decode_split_slots(wide, kv, split_keys)
                split = partial(
                    paged_attention_decode_split_triton,
                    *args_,
                    parts=torch.empty(slots, tokens, hq, dim, device=device),
                    part_lses=torch.empty(slots, tokens, hq, device=device),
                    out=out,
                    lse=lse,
                    keys_per_split=split_keys,
                )
                for bound_name, bound in (("real", keys), ("graph", args.graph_bound)):
                    variants[f"split{split_keys}_{bound_name}"] = partial(split, max_seq_len=bound)
                graph = partial(split, max_seq_len=args.graph_bound)
                counters = torch.zeros(tokens, hkv, dtype=torch.int32, device=device)
                variants[f"split{split_keys}_graph_merged"] = partial(  # no merge launch
                    graph, merge_in_launch=True, counters=counters
                )
                for plan in args.short_plans:  # the decode plan's key tile and pipelining
                    variants[f"split{split_keys}_graph_{plan}"] = with_short_plan(plan, graph)
            row = {"batch": batch, "context": keys}
            for name, fn in variants.items():
                fn()
                err = ((out.float() - base.float()).norm() / base.float().norm()).item()
                us = graph_time_us(fn, args.repeats)
                row[name] = {"us": us, "GBps": kv_bytes / us / 1e3, "rel_err_vs_one_pass": err}
            one = row["one_pass"]["us"]
            times = [
                f"{n} {v['us']:.1f}us ({one / v['us']:.2f}x)"
                for n, v in row.items()
                if isinstance(v, dict)
            ]
            results.setdefault("split_decode", []).append(row)
            print(f"RESULT split_decode b{batch} k{keys}: {' '.join(times)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU interpreter)")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--split-decode-only", action="store_true", help="only the split-KV decode section"
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--context", type=int, nargs="+", default=[128, 640, 4096])
    parser.add_argument(
        "--split-keys", type=int, nargs="+", default=sorted({128, DECODE_KEYS_PER_SPLIT, 512})
    )
    parser.add_argument("--graph-bound", type=int, default=4096, help="max_model_len")
    parser.add_argument(
        "--short-plans",
        nargs="*",
        default=[],
        help="other decode plans for the split decode, tTILE_wWARPS_sSTAGES (e.g. t128_w4_s2)",
    )
    parser.add_argument("--repeats", type=int, default=50, help="launches per timed graph")
    parser.add_argument(
        "--heads",
        type=int,
        nargs=3,
        metavar=("QUERY", "KV", "DIM"),
        default=[32, 8, 128],
        help="query heads, KV heads, head size (default Qwen3-8B's; Qwen3-Next's: 16 2 256)",
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    hq, hkv, dim, block = (4, 2, 32, 16) if args.tiny else (*args.heads, 16)
    group = hq // hkv
    repeat = 1 if args.tiny else 20
    results = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"}
    results["heads"] = [hq, hkv, dim]
    if args.tiny:
        args.graph_bound, args.repeats = 128, 1
    split_decode_cases(args, device, dtype, (hq, hkv, dim, block), results)
    if args.split_decode_only:
        if args.out:
            args.out.write_text(json.dumps(results, indent=2))
        return
    prefill_lengths = [40, 17] if args.tiny else [128, 256, 512, 768, 1024, 640, 384, 896]
    kv, table, qsl, lens, tokens = make_batch(
        prefill_lengths, hkv, dim, block, dtype, device, False
    )
    q = torch.randn(tokens, hq, dim, device=device).to(dtype)
    flops = sum(2 * 2 * n * (n + 1) / 2 * hq * dim for n in prefill_lengths)
    reference = None
    for name, plan in LONG_PLANS.items():
        override = None
        if plan is not None:
            if args.tiny:  # interpreter: small tiles, same code path
                plan = dict(plan, BLOCK_M=32, TILE=16)
            override = dict(plan, BLOCK_Q=plan["BLOCK_M"] // group, DIM_PAD=max(16, dim))

        run = partial(
            paged_attention_triton, q, kv, table, qsl, lens, dim**-0.5, _plan_override=override
        )

        out, _ = run()
        if reference is None:
            reference = out.float()
        err = ((out.float() - reference).norm() / reference.norm()).item()
        ms = time_ms(run, repeat)
        results[f"prefill_{name}"] = {"ms": ms, "TFLOPs": flops / ms / 1e9, "rel_err": err}
        print(f"RESULT prefill_{name} ms {ms:.3f} TFLOP/s {flops / ms / 1e9:.1f} err {err:.1e}")
    decode_cases = [(1, 128), (1, 640), (1, 4096), (8, 640), (256, 768), (1024, 768)]
    for batch, keys in [(1, 40)] if args.tiny else decode_cases:
        kv, table, qsl, lens, tokens = make_batch(
            [keys] * batch, hkv, dim, block, dtype, device, True
        )
        q = torch.randn(tokens, hq, dim, device=device).to(dtype)
        base, _ = paged_attention_triton(q, kv, table, qsl, lens, dim**-0.5, max_query_len=1)
        for splits in (1, 2, 4, 8):
            run = partial(
                paged_attention_triton,
                *(q, kv, table, qsl, lens, dim**-0.5),
                num_kv_splits=splits,
                max_query_len=1,
            )

            out, _ = run()
            err = ((out.float() - base.float()).norm() / base.float().norm()).item()
            us = time_ms(run, repeat * 10) * 1e3
            kv_bytes = 2 * batch * keys * hkv * dim * kv.element_size()
            gbps = kv_bytes / us / 1e3
            name = f"decode_b{batch}_k{keys}_splits{splits}"
            results[name] = {"us": us, "GBps": gbps, "rel_err": err}
            print(f"RESULT {name} us {us:.1f} GB/s {gbps:.0f} err {err:.1e}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
