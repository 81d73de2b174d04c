"""The int4 GEMV's dequantization: float32 (the old route) against 16-bit arithmetic
(gemv_triton's HALF_DEQUANT), µs per launch at Qwen3-8B's linears, 1 and 8 rows, in the
table's plan and a few other tilings; the two routes' outputs must be bitwise equal.

    python benchmarks/int4_gemv_dequant.py --out int4_gemv_dequant.json   # on a GPU
    python benchmarks/int4_gemv_dequant.py --tiny                         # script check (CPU)

Each launch is timed inside a CUDA graph over weight copies that do not fit in L2
(gemv_plans.time_graph_us). The floor is the packed weight and scale bytes at the card's
copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from unittest import mock

import torch

from kvloom.cluster.bench import copy_bandwidth
from kvloom.kernels import gemv_triton
from kvloom.kernels.gemv_triton import GemvPlan
from kvloom.kernels.quant_gemv_triton import choose_quant_gemv_plan, w4a16_gemv_triton
from kvloom.kernels.w4a16_gemm import pack_int4

sys.path.insert(0, str(Path(__file__).parent))
from gemv_plans import time_graph_us, time_wall_us, weight_copies  # noqa: E402

SHAPES = ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))
TINY_SHAPES = ((64, 256),)
ROWS = (1, 8)
# Tilings beside the table's. On an H200 (2026-12-06) 1 stage took twice 4 stages' time
# (the small loads' latency), hence deeper pipelines and split-K (more programs for
# 4,096-wide outputs; other bits than the table's split_k 1, still the same across routes).
CANDIDATES = (
    GemvPlan(16, 512, 4, 2),
    GemvPlan(32, 512, 4, 1),
    GemvPlan(16, 1024, 4, 2),
    GemvPlan(16, 512, 4, 6),
    GemvPlan(16, 512, 4, 8),
    GemvPlan(16, 256, 4, 8),
    GemvPlan(32, 512, 4, 6),
    GemvPlan(16, 512, 4, 4, 2),
    GemvPlan(16, 512, 4, 4, 4),
)
GROUP = 128


def weights(n: int, k: int, device: torch.device):
    g = torch.Generator(device="cpu").manual_seed(n * k)
    packed = pack_int4(torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8))
    scale = torch.rand(n, k // GROUP, generator=g) * 0.002 + 0.001
    return packed.to(device), scale.to(device, torch.bfloat16)


def run(shapes, device: torch.device) -> list[dict]:
    timer = time_graph_us if device.type == "cuda" else time_wall_us
    gbps = copy_bandwidth(device) / 1e9 if device.type == "cuda" else float("nan")
    rows_out = []
    for n, k in shapes:
        one = weights(n, k, device)
        nbytes = sum(t.numel() * t.element_size() for t in one)
        copies = [one] + [tuple(t.clone() for t in one) for _ in range(weight_copies(nbytes) - 1)]
        for m in ROWS:
            g = torch.Generator(device="cpu").manual_seed(m)
            x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
            table = choose_quant_gemv_plan(m, n, k, "int4")
            row = {"N": n, "K": k, "rows": m, "table_plan": table.name,
                   "floor_us": nbytes / gbps / 1e3, "float32_us": {}, "half_us": {}}  # fmt: skip
            bitwise = True
            for plan in (table, *(p for p in CANDIDATES if p != table)):

                def launch(i, plan=plan, x=x, copies=copies):
                    return w4a16_gemv_triton(x, *copies[i], GROUP, plan=plan)

                half = launch(0)
                row["half_us"][plan.name] = timer(launch, len(copies))
                with mock.patch.object(gemv_triton, "_half_dequant", lambda *a: False):
                    bitwise &= torch.equal(launch(0), half)
                    row["float32_us"][plan.name] = timer(launch, len(copies))
            row["bitwise_equal"] = bitwise
            row["half_best"] = min(row["half_us"], key=row["half_us"].get)
            rows_out.append(row)
            print(json.dumps(row), flush=True)
        del copies
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU script check)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = run(TINY_SHAPES if args.tiny else SHAPES, device)
    if not all(r["bitwise_equal"] for r in rows):
        print("RESULT int4_gemv_dequant bitwise MISMATCH", flush=True)
        sys.exit(1)
    if args.out:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        args.out.write_text(json.dumps({"device": name, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
