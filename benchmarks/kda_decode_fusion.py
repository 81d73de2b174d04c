"""Times Kimi Delta Attention (KDA) decode at Kimi-Linear's shape, narrow and wide tiles.

A KDA layer's decode kernels between the projections and o_proj (32 heads, 128 x 128
heads, conv width 4, bfloat16, float32 state; and TP 2's 16 heads): the conv update, then

  three   kda_gates, recurrence, output norm (RMSNorm x sigmoid(gate)): three launches
          (block_v 32, or 128 as `one`)
  two     gates computed in the recurrence (block_v 32), the norm separate
  one     gates, recurrence and norm in one launch (block_v 128: a program per value head)

The production plan (`kda_decode_triton` with no override, the kernel's `_TILE_ELEMENTS`) is
`two` at these heads; the JSON's production_block_v / production_variant say which variant
it is, computed from the kernel's tile budget, so the variants keep their meaning if it
changes. On an H100 `two` beat `one` at every row count, as Gated DeltaNet's twin
(benchmarks/gdn_decode_fusion.py) did (gpu_fast_path.md, thirteenth session).

    python3 benchmarks/kda_decode_fusion.py --out $OUT/kda_decode_fusion.json

Timing, bit checks and --tiny as benchmarks/gdn_decode_fusion.py, whose bench loop and
command line this runs over a KDA layer: each (rows, variant) is captured
LAUNCHES_PER_GRAPH times in one CUDA graph, rotating over copies of the state pools so every
step reads its state from HBM, and reported in µs per layer step (conv + the variant's
launches). Before timing, each variant's output and state are compared bitwise with the
three launches of the same block_v. Without CUDA (or with --tiny) it runs small shapes in
Triton's CPU interpreter, timing one call's wall time: that only exercises the script.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before triton is imported: it reads this once
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvloom.kernels.gated_delta_rule_triton import (  # noqa: E402
    _block_v,
    kda_decode_triton,
    recurrent_kda_triton,
)
from kvloom.kernels.kda_gated_norm_triton import kda_gated_norm_triton  # noqa: E402
from kvloom.kernels.kda_gates_triton import kda_gates_triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import gdn_decode_fusion  # noqa: E402

# (Hk, Hv, Dk, Dv, conv width), as gdn_decode_fusion's bench reads shapes; KDA has one head
# count (Hk == Hv). Kimi-Linear at TP 1 and TP 2.
SHAPES = {"kimi-linear": (32, 32, 128, 128, 4), "kimi-linear-tp2": (16, 16, 128, 128, 4)}
TINY_SHAPES = {"tiny": (2, 2, 16, 16, 4)}
ROWS = (1, 8, 32, 128)
TINY_ROWS = (1, 3)
EPS = 1e-5  # Kimi-Linear's rms_norm_eps
# name -> (block_v, fused gates, fused norm). Explicit block_v, never the production
# default, so a variant times the same kernel whatever the tile budget becomes.
VARIANTS = {
    "three_bv32": (32, False, False),
    "three_bv128": (128, False, False),
    "two_bv32": (32, True, False),
    # Narrower tiles than production's 32: more programs at one row (256 / 512 at 32
    # value heads), less state per program. An H100 (twenty-first session): bv16 2-5%
    # faster at one row (0.2-0.5 us), 24-56% slower at 8-128 rows (TP 2: 2-6% at 8);
    # bv8 no faster at one row and slower past it. Production keeps 32.
    "two_bv16": (16, True, False),
    "two_bv8": (8, True, False),
    "one_bv128": (128, True, True),
}
# The same four at 16 x 16 heads: block_v 8 is the narrow tile, 16 a whole head.
TINY_VARIANTS = {
    "three_bv8": (8, False, False),
    "three_bv16": (16, False, False),
    "two_bv8": (8, True, False),
    "one_bv16": (16, True, True),
}


def production_block_v(head_k: int, head_v: int) -> int:
    """The state columns per program `kda_decode_triton` takes with no override."""
    return _block_v(head_k, head_v)


class Layer(gdn_decode_fusion.Layer):
    """One KDA layer's decode inputs, cut as workers/layers/kda_layer.py cuts them, and
    `copies` state pools (conv + recurrent). The conv update (`qkv`: q, k, v split by head,
    as the layer's _conv_update) and the state copies are Gated DeltaNet's layer's."""

    def __init__(self, rows, hk, hv, dk, dv, width, copies, device, seed):
        assert hk == hv, "KDA: one head count for q, k and v"
        gen = torch.Generator(device="cpu").manual_seed(seed)
        heads, channels = hv, hk * (2 * dk + dv)
        dtype = torch.bfloat16

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen) * scale).to(device)

        # qkv_proj's output: q | k | v (the conv's input) then beta's logits, both strided
        # column views of it as the layer's _project splits them.
        proj = randn(rows, channels + heads).to(dtype)
        self.mixed, self.beta_logits = proj.split([channels, heads], dim=-1)
        # f_b_proj's and g_b_proj's outputs, viewed [N, H, D] (contiguous) as the layer does.
        self.raw_gate = randn(rows, heads * dk, scale=2.0).to(dtype).view(rows, heads, dk)
        self.gate = randn(rows, heads * dv, scale=2.0).to(dtype).view(rows, heads, dv)
        self.conv_weight = randn(channels, width, scale=0.5).to(dtype)
        # Parameters in the model's dtype, as KimiDeltaAttention holds them.
        self.A_log = randn(heads, scale=0.5).to(dtype)
        self.dt_bias = randn(heads * dk, scale=0.5).to(dtype)
        self.norm_weight = (randn(dv, scale=0.2) + 1).to(dtype)
        self.shape = (hk, hv, dk, dv)
        self.slots = torch.arange(rows, dtype=torch.int32, device=device)
        self.conv = [randn(rows, channels, width - 1).to(dtype) for _ in range(copies)]
        self.state = [randn(rows, hv, dk, dv, scale=0.1) for _ in range(copies)]

    def step(self, i, block_v, fused_gates, fused_norm):
        q, k, v = self.qkv(i)
        _, _, dk, dv = self.shape
        gates = (self.raw_gate, self.A_log, self.dt_bias, self.beta_logits)
        norm = (self.gate, self.norm_weight, EPS)
        if fused_gates:  # one launch where a program holds a whole value head, else two
            assert fused_norm == ((block_v or production_block_v(dk, dv)) >= dv)
            return kda_decode_triton(
                q, k, v, *gates, self.state[i], self.slots, *norm, use_qk_l2norm=True,
                norm_tail=self.norm_tail, _block_v_override=block_v,
            )  # fmt: skip
        # The three launches, as tests/test_kda_decode_fusion.py's `separate`.
        g, beta = kda_gates_triton(*gates)
        core = recurrent_kda_triton(
            q, k, v, g, beta, self.state[i], self.slots, use_qk_l2norm=True,
            _block_v_override=block_v,
        )  # fmt: skip
        return kda_gated_norm_triton(core, *norm)


def production_plans() -> dict[str, dict]:
    """Per shape (full and tiny): the production plan's block_v and the variant it equals
    (gates fused; the norm fused where the tile holds a whole value head), None if none."""
    block_vs, names = {}, {}
    for shapes, variants in ((SHAPES, VARIANTS), (TINY_SHAPES, TINY_VARIANTS)):
        for shape_name, (_, _, dk, dv, _) in shapes.items():
            bv = production_block_v(dk, dv)
            plan = (bv, True, bv >= dv)
            block_vs[shape_name] = bv
            names[shape_name] = next((n for n, v in variants.items() if v == plan), None)
    return dict(production_block_v=block_vs, production_variant=names)


def main(argv: list[str] | None = None) -> dict:
    plans = production_plans()
    result = gdn_decode_fusion.main(
        argv,
        doc=__doc__,
        layer_cls=Layer,
        shapes=SHAPES,
        tiny_shapes=TINY_SHAPES,
        rows=ROWS,
        tiny_rows=TINY_ROWS,
        variants=VARIANTS,
        tiny_variants=TINY_VARIANTS,
        **plans,
    )
    # Last, so that a log's tail (gpu_fast_path.sh keeps 20 lines) shows them.
    for shape_name, bv in plans["production_block_v"].items():
        variant = plans["production_variant"][shape_name]
        print(f"PLAN {shape_name} production block_v={bv} variant={variant}")
    return result


if __name__ == "__main__":
    main()
