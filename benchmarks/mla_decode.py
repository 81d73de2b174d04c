"""MLA decode attention at Kimi-Linear's widths (kv_lora_rank 512, rope 64, bfloat16): the
MLA kernel (kernels/mla_attention_triton.py, what ops.mla_attention runs on CUDA) against
the generic paged attention kernel over the latent cache seen as keys = values (the path
ops.mla_attention took before issue 23), over a grid of batch sizes and contexts.

Each kernel is timed inside a CUDA graph of `--repeats` back-to-back launches (no host
overhead), reported as µs per launch and as GB/s of unique latent cache read
(batch x context x (r + dr) x element size; the generic kernel reads those bytes twice).
Both are checked against the torch reference on the first rows.

    python benchmarks/mla_decode.py [--batch 1 8 64 256] [--context 128 1024 4096]
        [--heads 32] [--out FILE.json]
    python benchmarks/mla_decode.py --tiny   # CPU, Triton's interpreter, tiny widths
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--tiny" in sys.argv:  # the interpreter is chosen when triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from kvloom.kernels.mla_attention import mla_attention_ref  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from graph_timing import graph_time_us  # noqa: E402

from kvloom.kernels.mla_attention_triton import mla_attention_triton, mla_plan  # noqa: E402
from kvloom.kernels.ops import latent_cache_as_kv  # noqa: E402
from kvloom.kernels.paged_attention_triton import paged_attention_triton  # noqa: E402

CHECK_ROWS = 8  # rows compared with the (slow, row-by-row) reference


def time_us(fn, repeats: int, cuda: bool) -> float:
    """µs per call: on CUDA, one graph of `repeats` calls replayed (after a warm-up)."""
    if not cuda:
        fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats * 1e6
    return graph_time_us(fn, repeats)


def run_one(batch, context, args, dev, dtype) -> dict:
    rank, rope, heads, page = args.rank, args.rope, args.heads, args.block_size
    blocks_per_row = -(-context // page)
    num_blocks = batch * blocks_per_row + 1  # page 0: the null page
    cache = torch.randn(num_blocks, page, rank + rope, device=dev, dtype=dtype)
    # Each row's pages shuffled over the pool, as a long-running server's would be.
    order = 1 + torch.randperm(num_blocks - 1, device=dev).to(torch.int32)
    tables = order.view(batch, blocks_per_row)
    starts = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
    q_latent = torch.randn(batch, heads, rank, device=dev, dtype=dtype)
    q_pe = torch.randn(batch, heads, rope, device=dev, dtype=dtype)
    scale = (128 + rope) ** -0.5
    query = torch.cat([q_latent, q_pe], dim=-1)  # the generic path's q, built once
    kv = latent_cache_as_kv(cache)

    def mla():
        return mla_attention_triton(q_latent, q_pe, cache, tables, starts, lens, scale)[0]

    def mla_one_head_block():  # every head in one program: the cache read once a row
        plan = dict(mla_plan(heads, dtype), HEAD_BLOCK=heads, BLOCK_M=heads, BLOCK_Q=1)
        plan["num_warps"] = 8  # a [heads, 512] float32 accumulator
        return mla_attention_triton(
            q_latent, q_pe, cache, tables, starts, lens, scale, _plan_override=plan
        )[0]

    def generic():
        out, _ = paged_attention_triton(query, kv, tables, starts, lens, scale, max_query_len=1)
        return out[..., :rank]

    rows = min(batch, CHECK_ROWS)
    ref = mla_attention_ref(
        q_latent[:rows], q_pe[:rows], cache, tables[:rows], starts[: rows + 1], lens[:rows], scale
    )[0].float()
    cache_bytes = batch * context * (rank + rope) * cache.element_size()
    result = {"batch": batch, "context": context, "heads": heads, "cache_bytes": cache_bytes}
    kernels = {"mla": mla, "generic": generic}
    if heads & (heads - 1) == 0 and heads > 16:  # a power of two: one program a row
        kernels["mla_one_head_block"] = mla_one_head_block
    for name, fn in kernels.items():
        result[f"{name}_max_abs_diff"] = (fn()[:rows].float() - ref).abs().max().item()
        us = time_us(fn, args.repeats, dev == "cuda")
        result[f"{name}_us"] = float(f"{us:.4g}")
        result[f"{name}_GBps"] = float(f"{cache_bytes / us / 1e3:.4g}")
    result["generic_over_mla"] = round(result["generic_us"] / result["mla_us"], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--context", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--rank", type=int, default=512)
    parser.add_argument("--rope", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--tiny", action="store_true", help="CPU interpreter, tiny widths")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.tiny:
        dev, dtype = "cpu", torch.float32
        args.batch, args.context, args.heads = [1, 4], [16, 40], 32
        args.rank, args.rope, args.block_size, args.repeats = 32, 16, 4, 2
    else:
        dev, dtype = "cuda", torch.bfloat16
    results = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreted)",
        "dtype": str(dtype),
        "rank": args.rank,
        "rope": args.rope,
        "block_size": args.block_size,
        "runs": [],
    }
    for batch in args.batch:
        for context in args.context:
            run = run_one(batch, context, args, dev, dtype)
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
