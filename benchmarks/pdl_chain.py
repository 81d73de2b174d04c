"""Batch-1 decode launch chains with and without programmatic dependent launch, one GPU.

Each layer of a dense decoder at one row, as kvloom's decode path launches it, without
attention: residual add + RMSNorm, the qkv GEMV, the o GEMV, residual add + RMSNorm, the
gate_up GEMV with SiLU-and-mul at its store, the down GEMV. `--layers` of them (each with
its own weights, so nothing stays in L2) are captured in one CUDA graph per PDL setting:
off, and KVLOOM_PDL_RELEASE start / loop / exit (kernels/pdl_triton.py). Prints µs per
layer, the share of the weight-bytes floor at the measured copy rate, and whether each
setting gave the off chain's bits; writes JSON with --out.

    python benchmarks/pdl_chain.py [--shape qwen3-8b] [--layers 36] [--replays 20] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from kvloom.kernels.gemv_triton import gemv_silu_and_mul_triton, gemv_triton
from kvloom.kernels.rms_norm_triton import rms_norm_triton

SHAPES = {  # hidden, q width (heads x head dim), k + v width, intermediate
    "qwen3-8b": (4096, 4096, 2048, 12288),
    "qwen3-32b": (5120, 8192, 2048, 25600),
}
SETTINGS = ("off", "start", "loop", "exit")


def make_layers(shape: tuple, layers: int, device: str = "cuda") -> list[dict]:
    hidden, q, kv, inter = shape
    gen = torch.Generator(device=device).manual_seed(0)

    def weight(n, k):
        return (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(torch.bfloat16)

    def norm():
        return torch.rand(hidden, generator=gen, device=device).to(torch.bfloat16) + 0.5

    return [
        dict(
            norm1=norm(),
            qkv=weight(q + kv, hidden),
            o=weight(hidden, q),
            norm2=norm(),
            gate_up=weight(2 * inter, hidden),
            down=weight(hidden, inter),
        )
        for _ in range(layers)
    ]


def chain(x: torch.Tensor, layers: list[dict]) -> torch.Tensor:
    residual = x
    h = x
    for w in layers:
        h, residual = rms_norm_triton(h, w["norm1"], 1e-6, residual=residual)
        qkv = gemv_triton(h, w["qkv"])
        h = gemv_triton(qkv[:, : w["o"].shape[1]], w["o"])  # stands in for attention's output
        h, residual = rms_norm_triton(h, w["norm2"], 1e-6, residual=residual)
        h = gemv_triton(gemv_silu_and_mul_triton(h, w["gate_up"]), w["down"])
    return h + residual


def copy_rate_gbs() -> float:
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) * 1e-3) / 1e9


def time_setting(setting: str, x: torch.Tensor, layers: list[dict], replays: int):
    os.environ.pop("KVLOOM_UNFUSED", None)
    if setting == "off":
        os.environ.pop("KVLOOM_FUSED", None)
    else:
        os.environ["KVLOOM_FUSED"] = "pdl"
        os.environ["KVLOOM_PDL_RELEASE"] = setting
    chain(x, layers)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = chain(x, layers)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays, y.clone()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("pdl_chain.py needs a CUDA GPU", file=sys.stderr)
        return 2
    hidden = SHAPES[args.shape][0]
    layers = make_layers(SHAPES[args.shape], args.layers)
    layer_bytes = sum(t.numel() * t.element_size() for t in layers[0].values())
    rate = copy_rate_gbs()
    floor_us = layer_bytes / (rate * 1e9) * 1e6
    x = torch.randn(1, hidden, device="cuda").to(torch.bfloat16)
    rows, want = [], None
    for setting in args.settings:
        us, y = time_setting(setting, x, layers, args.replays)
        want = y if want is None else want
        row = dict(
            setting=setting,
            us_per_layer=round(us / args.layers, 2),
            floor_share=round(floor_us * args.layers / us, 4),
            bitwise_as_first=bool(torch.equal(y, want)),
        )
        rows.append(row)
        print("RESULT", json.dumps(row), flush=True)
    result = dict(
        shape=args.shape,
        layers=args.layers,
        device=torch.cuda.get_device_name(),
        copy_gbs=round(rate, 1),
        layer_weight_bytes=layer_bytes,
        floor_us_per_layer=round(floor_us, 2),
        results=rows,
    )
    print(json.dumps({k: v for k, v in result.items() if k != "results"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
