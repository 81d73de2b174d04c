"""Times the two attention-side decode fusions against the launches they replace, at the
decode shapes (batch 1 and 2, bf16):

- norm+rope+write: `qk_norm_rope_kv_write_triton` (q/k RMSNorm, rotary and the paged-cache
  write of k and v in one launch) against `qk_norm_rope_triton` then `write_kv_cache_triton`,
  on Qwen3-8B's attention (32 / 8 heads of 128, full rotary), Qwen3-Next's (16 / 2 heads
  of 256, rotary 64, (1 + w) norms) and Llama-3-8B's (rotary only), bf16 and FP8 caches;
- output gate: `mul_sigmoid_triton` (Qwen3-Next's out * sigmoid(gate), the gate read in
  place) against torch's `out * torch.sigmoid(gate.reshape(T, -1))` (copy, sigmoid, mul).

Each variant runs REPEATS times back to back in one CUDA graph (benchmarks/graph_timing.py,
best of REPLAYS replays): µs per layer step, as the decode graphs run it. Before timing,
the fused results are compared bitwise with the unfused ones (`same_bits`).

    python3 benchmarks/attention_launch_fusion.py --out $OUT/attention_launch_fusion.json

`--tiny` runs small shapes, also on a CPU under TRITON_INTERPRET=1 (wall time of one call:
exercises the script only).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "--tiny" in sys.argv and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # chosen when triton is first imported

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import graph_timing  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":  # make the interpreter round bf16 as the GPU
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from tests.triton_interpret.conftest import round_bfloat16_like_the_gpu

    round_bfloat16_like_the_gpu()

from kvloom.kernels.activation import mul_sigmoid_ref  # noqa: E402
from kvloom.kernels.activation_triton import mul_sigmoid_triton  # noqa: E402
from kvloom.kernels.kv_cache_write import FP8_DTYPE  # noqa: E402
from kvloom.kernels.kv_cache_write_triton import write_kv_cache_triton  # noqa: E402
from kvloom.kernels.qk_norm_rope_triton import (  # noqa: E402
    qk_norm_rope_kv_write_triton,
    qk_norm_rope_triton,
)

REPEATS = 200
REPLAYS = 5
BATCHES = (1, 2)
BLOCK_SIZE = 16
NUM_BLOCKS = 1024
MAX_POS = 40960
# name: (q_heads, k_heads, head_dim, rotary_dim, weight_offset or None for rotary only)
ATTENTION_SHAPES = {
    "qwen3_8b": (32, 8, 128, 128, 0.0),
    "qwen3_next": (16, 2, 256, 64, 1.0),
    "llama3_8b": (32, 8, 128, 128, None),
}
TINY_ATTENTION_SHAPES = {"tiny": (4, 2, 32, 16, 1.0)}
GATE_SHAPES = {"qwen3_next": (16, 256)}  # heads per rank at TP = 1, head dim
TINY_GATE_SHAPES = {"tiny": (2, 32)}


def rope_case(tokens, q_heads, k_heads, dim, rotary_dim, offset, device, gen):
    """The kernels' arguments as the layers pass them: q/k/v head views of one fused
    projection output, real cos/sin tables, one cache slot per token."""
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * dim, generator=gen, device=device)
    qkv = (qkv * 3).to(torch.bfloat16)
    q = qkv[:, : q_heads * dim].view(tokens, q_heads, dim)
    k = qkv[:, q_heads * dim : (q_heads + k_heads) * dim].view(tokens, k_heads, dim)
    v = qkv[:, (q_heads + k_heads) * dim :].view(tokens, k_heads, dim)
    inv_freq = 1e6 ** (-torch.arange(0, rotary_dim, 2, device=device) / rotary_dim)
    angles = torch.arange(MAX_POS, device=device)[:, None] * inv_freq
    positions = torch.randint(0, MAX_POS, (tokens,), generator=gen, device=device)
    if offset is None:
        weights, offset = (None, None), 0.0
    else:
        centre = 0.0 if offset else 1.0
        weights = tuple(
            (torch.randn(dim, generator=gen, device=device) * 0.2 + centre).to(torch.bfloat16)
            for _ in range(2)
        )
    norm_args = (positions, angles.cos(), angles.sin(), *weights, 1e-6, rotary_dim, offset)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen, device=device)[:tokens]
    return q, k, v, norm_args, slots


def bench_rope(name, shape, tokens, cache_dtype, device, timer, log) -> dict:
    q_heads, k_heads, dim = shape[:3]
    gen = torch.Generator(device=device).manual_seed(tokens)
    q, k, v, norm_args, slots = rope_case(tokens, *shape, device, gen)
    scales = (0.5, 0.25) if cache_dtype == FP8_DTYPE else (1.0, 1.0)
    caches = [
        torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, k_heads, dim, device=device).to(cache_dtype)
        for _ in range(2)
    ]

    def two_launches():
        q_out, k_out = qk_norm_rope_triton(q, k, *norm_args)
        write_kv_cache_triton(k_out, v, caches[0], slots, *scales)
        return q_out, k_out

    def fused():
        return qk_norm_rope_kv_write_triton(
            q, k, v, *norm_args, caches[1], slots, *scales
        )  # fmt: skip

    same = all(torch.equal(a, b) for a, b in zip(two_launches(), fused(), strict=True))
    same = same and torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    before, after = timer(two_launches), timer(fused)
    row = dict(
        op="norm_rope_write", shape=name, tokens=tokens, cache=str(cache_dtype).split(".")[-1],
        us_two_launches=before, us_fused=after, saved_us=before - after, same_bits=same,
    )  # fmt: skip
    log(
        f"RESULT norm_rope_write {name} T={tokens} cache={row['cache']} "
        f"two_launches={before:.2f}us fused={after:.2f}us same_bits={same}"
    )
    return row


def bench_gate(name, shape, tokens, device, timer, log) -> dict:
    heads, dim = shape
    gen = torch.Generator(device=device).manual_seed(tokens)
    q_gate = torch.randn(tokens, heads, 2 * dim, generator=gen, device=device)
    gate = (q_gate * 3).to(torch.bfloat16)[..., dim:]  # strided, as the layer's view
    out = torch.randn(tokens, heads * dim, generator=gen, device=device).to(torch.bfloat16)
    same = torch.equal(mul_sigmoid_triton(out, gate), mul_sigmoid_ref(out, gate))
    before = timer(lambda: mul_sigmoid_ref(out, gate))
    after = timer(lambda: mul_sigmoid_triton(out, gate))
    row = dict(
        op="output_gate", shape=name, tokens=tokens, us_torch=before, us_fused=after,
        saved_us=before - after, same_bits=same,
    )  # fmt: skip
    log(
        f"RESULT output_gate {name} T={tokens} torch={before:.2f}us fused={after:.2f}us "
        f"same_bits={same}"
    )
    return row


def time_wall_us(fn) -> float:
    """No GPU: wall time of one call (interpreter; exercises the script only)."""
    begin = time.perf_counter()
    fn()
    return (time.perf_counter() - begin) * 1e6


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="JSON results")
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU interpreter)")
    args = parser.parse_args(argv)
    start = time.monotonic()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        timer = lambda fn: graph_timing.graph_time_us(fn, REPEATS, REPLAYS)  # noqa: E731
    else:
        timer = time_wall_us
    attention = TINY_ATTENTION_SHAPES if args.tiny else ATTENTION_SHAPES
    gates = TINY_GATE_SHAPES if args.tiny else GATE_SHAPES
    rows = []
    for name, shape in attention.items():
        for tokens in BATCHES:
            for cache_dtype in (torch.bfloat16, FP8_DTYPE):
                rows.append(bench_rope(name, shape, tokens, cache_dtype, device, timer, print))
    for name, shape in gates.items():
        for tokens in BATCHES:
            rows.append(bench_gate(name, shape, tokens, device, timer, print))
    return graph_timing.write_result(
        args.out,
        start,
        rows,
        repeats_per_graph=REPEATS,
    )


if __name__ == "__main__":
    main()
