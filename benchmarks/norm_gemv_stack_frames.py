"""Stack-frame (register spill) bytes per thread of the fused RMSNorm + GEMV launch built
for sm_90, at real decode shapes, for the GEMV's chosen plan and the same plan with fewer
pipeline stages. Needs no GPU: kernels are built by Triton's compiler and ptxas under
tests/hopper_compile.py's compile-only driver, and measured with cuobjdump.

    PYTHONPATH=$PWD python benchmarks/norm_gemv_stack_frames.py [--out stack.json]

With `TRITON_VERSION=3.6.0 bash scripts/hopper_compile_check.sh` run once, put its Triton
first on PYTHONPATH ($TMPDIR/kvloom-triton-3.6.0) to build with the GPU machines' version.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))
import torch  # noqa: E402
from triton.runtime import driver  # noqa: E402

import tests.hopper_compile as build  # noqa: E402  (sets up the compile-only mode)
from kvloom.kernels.gemv_triton import choose_gemv_plan, rms_norm_gemv_triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from norm_gemv_fusion import SHAPES  # noqa: E402  (name, K, N, SiLU, norm offset, conv)

STAGES = (1, 2, 3)


def stack_bytes(x, res, norm_w, weight, silu, offset, plan) -> tuple[int, int]:
    """(stack bytes, registers) per thread of the fused launch with `plan` (the norm
    and GEMV only: a GDN in_proj's conv epilogue is left out)."""
    before = len(build.REPORT.spilling)
    rms_norm_gemv_triton(
        x, res, norm_w, 1e-6, weight, weight_offset=offset, silu_and_mul=silu, plan=plan
    )
    new = build.REPORT.spilling[before:]
    return (new[0]["bytes"], new[0]["registers"]) if new else (0, 0)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="JSON results")
    args = parser.parse_args(argv)
    driver.set_active(build.CompileOnlyDriver())
    build.REPORT.wrap_compile()
    rows = []
    for name, k, n, silu, offset, _conv in SHAPES:
        weight = torch.zeros(n, k, dtype=torch.bfloat16)
        norm_w = torch.ones(k, dtype=torch.bfloat16)
        for m in (1, 2):
            x = torch.zeros(m, k, dtype=torch.bfloat16)
            res = torch.zeros_like(x)
            chosen = choose_gemv_plan(m, n, k, torch.bfloat16)
            stages = sorted({chosen.num_stages, *STAGES}, reverse=True)
            by_stages = {}
            for num_stages in stages:
                plan = dataclasses.replace(chosen, num_stages=num_stages)
                by_stages[num_stages] = stack_bytes(x, res, norm_w, weight, silu, offset, plan)[0]
            rows.append({"shape": name, "rows": m, "plan": chosen.name, "stack": by_stages})
            cells = " ".join(f"s{s}={b}" for s, b in by_stages.items())
            print(f"STACK {name} m={m} plan={chosen.name} {cells}", flush=True)
    result = {"target": "cuda sm_90", "triton": build.triton.__version__, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
