"""Tokens per program of the q/k norm + rotary + KV-write launch, timed in CUDA graphs.

Qwen3-8B's heads (32 q, 8 kv, head 128, bf16) at prefill and decode token counts; for each
count, each tokens-per-program setting is checked bitwise against one token a program
(q, k and the cache) and timed; prints µs per launch and the achieved GB/s (q, k, v read;
q, k and the cache rows written).

    python benchmarks/qk_norm_rope_plans.py [--tokens 256 1024 4096 16384]
        [--per-program 1 2 4 8 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import graph_timing  # noqa: E402

from kvloom.kernels import qk_norm_rope_triton as qr  # noqa: E402

Q_HEADS, K_HEADS, DIM, BLOCK = 32, 8, 128, 16


def case(tokens: int):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    qkv = torch.randn(tokens, (Q_HEADS + 2 * K_HEADS) * DIM, generator=gen, device="cuda")
    qkv = qkv.to(torch.bfloat16)
    q = qkv[:, : Q_HEADS * DIM].view(tokens, Q_HEADS, DIM)
    k = qkv[:, Q_HEADS * DIM : (Q_HEADS + K_HEADS) * DIM].view(tokens, K_HEADS, DIM)
    v = qkv[:, (Q_HEADS + K_HEADS) * DIM :].view(tokens, K_HEADS, DIM)
    positions = torch.randint(0, 4096, (tokens,), generator=gen, device="cuda")
    inv_freq = 1e6 ** (-torch.arange(0, DIM, 2, dtype=torch.float32, device="cuda") / DIM)
    angles = torch.arange(40960, dtype=torch.float32, device="cuda")[:, None] * inv_freq
    weights = [torch.rand(DIM, generator=gen, device="cuda").to(torch.bfloat16) + 0.5] * 2
    blocks = -(-tokens // BLOCK) + 1
    cache = torch.zeros(2, blocks, BLOCK, K_HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    slots = torch.randperm((blocks - 1) * BLOCK, device="cuda")[:tokens] + BLOCK
    return (q, k, v, positions, angles.cos(), angles.sin(), *weights, 1e-6, None, 0.0), cache, slots


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument("--per-program", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("qk_norm_rope_plans.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for tokens in args.tokens:
        launch_args, cache, slots = case(tokens)
        # read q, k, v; write q, k and the cache's k, v rows (bf16)
        moved = tokens * (2 * Q_HEADS + 5 * K_HEADS) * DIM * 2
        want = None
        for per_program in args.per_program:
            qr.tokens_per_program = lambda num_tokens, n=per_program: n

            def run(launch_args=launch_args, cache=cache, slots=slots):
                return qr.qk_norm_rope_kv_write_triton(*launch_args, cache, slots)

            got = (*run(), cache.clone())
            want = want or got
            us = graph_timing.graph_time_us(run, args.repeats)
            row = dict(
                tokens=tokens,
                per_program=per_program,
                us=round(us, 2),
                GBps=round(moved / us / 1e3, 1),
                bitwise_as_one=all(torch.equal(g, w) for g, w in zip(got, want, strict=True)),
            )
            rows.append(row)
            print("RESULT", json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(
            json.dumps(dict(device=torch.cuda.get_device_name(), results=rows), indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
