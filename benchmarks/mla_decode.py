"""MLA decode attention on the GPU: kernels/ops.mla_attention (the paged attention kernel
over the latent cache seen as keys = values) against the pure-torch MLA reference, at
Kimi-Linear's widths (kv_lora_rank 512, rope 64), bfloat16.

    python benchmarks/mla_decode.py --batch 64 --context 2048 --heads 32 [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvloom.kernels.mla_attention import mla_attention_ref
from kvloom.kernels.ops import mla_attention


def timed(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    rank, rope, dtype, dev = 512, 64, torch.bfloat16, "cuda"
    blocks_per_row = -(-args.context // args.block_size)
    num_blocks = args.batch * blocks_per_row + 1
    cache = torch.randn(num_blocks, args.block_size, rank + rope, device=dev, dtype=dtype)
    tables = (1 + torch.arange(args.batch * blocks_per_row, device=dev, dtype=torch.int32)).view(
        args.batch, -1
    )
    starts = torch.arange(args.batch + 1, device=dev, dtype=torch.int32)
    lens = torch.full((args.batch,), args.context, device=dev, dtype=torch.int32)
    q_latent = torch.randn(args.batch, args.heads, rank, device=dev, dtype=dtype)
    q_pe = torch.randn(args.batch, args.heads, rope, device=dev, dtype=dtype)
    scale = (128 + rope) ** -0.5

    def kernel():
        return mla_attention(q_latent, q_pe, cache, tables, starts, lens, scale, max_query_len=1)

    def reference():
        return mla_attention_ref(q_latent, q_pe, cache, tables, starts, lens, scale)[0]

    max_diff = (kernel().float() - reference().float()).abs().max().item()
    cache_bytes = args.batch * args.context * (rank + rope) * 2
    result = {
        "device": torch.cuda.get_device_name(),
        "batch": args.batch,
        "context": args.context,
        "heads": args.heads,
        "kernel_ms": timed(kernel, args.repeats),
        "reference_ms": timed(reference, max(1, args.repeats // 4)),
        "max_abs_diff": max_diff,
        "cache_bytes": cache_bytes,
    }
    result["kernel_cache_read_GBps"] = cache_bytes / result["kernel_ms"] / 1e6
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
