"""Times a Gated DeltaNet layer's decode kernels between in_proj and out_proj at the
Qwen3-Next shape (16 key heads, 32 value heads, 128 x 128 heads, conv width 4, bfloat16,
float32 state): the conv update, then

  three   gdn_gates, recurrence, gated RMSNorm: three launches (block_v 32, or 128 as `one`)
  two     gates computed in the recurrence (block_v 32), the norm in that launch by each
          head's last program (the norm tail) at up to NORM_TAIL_MAX_ROWS rows, else
          separate: the production plan (gpu_fast_path.md); `--norm-tail on|off` forces the
          tail either way; two_bv16 / two_bv8 / two_bv64 the same with other tiles
  one     gates, recurrence and norm in one launch (block_v 128: a program per value head)

    python3 benchmarks/gdn_decode_fusion.py --out $OUT/gdn_decode_fusion.json
    python3 benchmarks/gdn_decode_fusion.py --state-dtype bfloat16 --rows 1 128 512
    python3 benchmarks/gdn_decode_fusion.py --norm-tail off --rows 1 8 32 128

`--state-dtype bfloat16` keeps the recurrent state as `--linear-state-dtype auto` does
(vLLM's default): half the bytes, which at about 600 decode rows the production tile read
at half the float32 state's rate (gpu_fast_path.md, twenty-sixth session).

Timing as benchmarks/gemv_plans.py: each (rows, variant) is captured LAUNCHES_PER_GRAPH
times back to back in one CUDA graph, rotating over copies of the state pools so every
step reads its state from HBM (as 18 layers do), and timed with CUDA events over the
replays: µs per layer step (conv + the variant's launches). Before timing, each variant's
output and state are compared bitwise with the three launches of the same block_v.
Without CUDA (or with --tiny) it runs small shapes in Triton's CPU interpreter, timing
the wall time of one call: that only exercises the script.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before triton is imported: it reads this once
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvloom.kernels.causal_conv1d_triton import causal_conv1d_update_triton  # noqa: E402
from kvloom.kernels.gated_delta_rule_triton import (  # noqa: E402
    gdn_decode_triton,
    recurrent_gated_delta_rule_triton,
)
from kvloom.kernels.gated_rms_norm_triton import gated_rms_norm_triton  # noqa: E402
from kvloom.kernels.gdn_gates_triton import gdn_gates_triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import graph_timing  # noqa: E402
from gemv_plans import (  # noqa: E402
    LAUNCHES_PER_GRAPH,
    REPLAYS,
    time_graph_us,
    time_wall_us,
    weight_copies,
)

# (Hk, Hv, Dk, Dv, conv width): Qwen3-Next at TP 1 and TP 2.
SHAPES = {"qwen3-next": (16, 32, 128, 128, 4), "qwen3-next-tp2": (8, 16, 128, 128, 4)}
TINY_SHAPES = {"tiny": (2, 4, 16, 16, 4)}
ROWS = (1, 8, 32, 128)
TINY_ROWS = (1, 3)
EPS = 1e-6
# name -> (block_v, fused gates, fused norm); block_v None: the production plan.
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
    # Wider: twice the state bytes a program holds, which a bf16 state may need.
    "two_bv64": (64, True, False),
    "one_bv128": (128, True, True),
    # The production plan: narrow tiles and the norm tail's row bound, unless --norm-tail
    # forces it.
    "plan": (None, True, True),
}
# --norm-tail's choices -> `norm_tail` of the fused steps (None: uses_norm_tail's rule).
NORM_TAIL = {"rule": None, "on": True, "off": False}
TINY_VARIANTS = {"three": (8, False, False), "two": (8, True, False), "one": (None, True, True)}


class Layer:
    """One layer's decode inputs and `copies` state pools (conv + recurrent). `norm_tail`:
    the fused steps' norm tail forced on or off, or None (`uses_norm_tail`'s rule)."""

    norm_tail: bool | None = None

    def __init__(self, rows, hk, hv, dk, dv, width, copies, device, seed):
        gen = torch.Generator(device="cpu").manual_seed(seed)
        r, channels = hv // hk, 2 * hk * dk + hv * dv
        dtype = torch.bfloat16

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen) * scale).to(device)

        proj = randn(rows, channels + hv * dv + 2 * hv).to(dtype)  # in_proj's output
        self.mixed, z, self.ba = proj.split([channels, hv * dv, 2 * hv], dim=-1)
        self.z = z.view(rows, hv, dv)
        self.conv_weight = randn(channels, width, scale=0.5).to(dtype)
        self.A_log, self.dt_bias = randn(hv, scale=0.5).to(dtype), randn(hv).to(dtype)
        self.norm_weight = (randn(dv, scale=0.2) + 1).to(dtype)
        self.group, self.shape = r, (hk, hv, dk, dv)
        self.slots = torch.arange(rows, dtype=torch.int32, device=device)
        self.conv = [randn(rows, channels, width - 1).to(dtype) for _ in range(copies)]
        self.state = [randn(rows, hv, dk, dv, scale=0.1) for _ in range(copies)]

    def qkv(self, i):
        hk, hv, dk, dv = self.shape
        x = causal_conv1d_update_triton(
            self.mixed, self.conv_weight, None, self.conv[i], self.slots, "silu"
        )
        q, k, v = x.split([hk * dk, hk * dk, hv * dv], dim=-1)
        rows = x.shape[0]
        return q.view(rows, hk, dk), k.view(rows, hk, dk), v.view(rows, hv, dv)

    def step(self, i, block_v, fused_gates, fused_norm):
        q, k, v = self.qkv(i)
        dv = self.shape[3]
        gates = (self.ba, self.A_log, self.dt_bias, self.group)
        if fused_gates:  # one launch, or two where block_v < Dv (the norm separate)
            assert fused_norm == (block_v is None or block_v >= dv)
            return gdn_decode_triton(
                q, k, v, *gates, self.state[i], self.slots, self.z, self.norm_weight, EPS,
                use_qk_l2norm=True, norm_tail=self.norm_tail, _block_v_override=block_v,
            )  # fmt: skip
        g, beta = gdn_gates_triton(*gates)
        core = recurrent_gated_delta_rule_triton(
            q, k, v, g, beta, self.state[i], self.slots, use_qk_l2norm=True,
            _block_v_override=block_v,
        )  # fmt: skip
        return gated_rms_norm_triton(core, self.z, self.norm_weight, EPS)

    def state_snapshot(self, i):
        return self.conv[i].clone(), self.state[i].clone()

    def restore(self, i, snapshot):
        self.conv[i].copy_(snapshot[0])
        self.state[i].copy_(snapshot[1])


def same_bits(layer: Layer, variant, block_v) -> bool:
    """One step of `variant` against the three launches of the same block_v, from the
    same state (restored after)."""
    snapshot = layer.state_snapshot(0)
    want = layer.step(0, block_v, False, False)
    want_state = layer.state[0].clone()
    layer.restore(0, snapshot)
    got = layer.step(0, *variant)
    ok = torch.equal(got, want) and torch.equal(layer.state[0], want_state)
    layer.restore(0, snapshot)
    return bool(ok)


def bench(
    shapes,
    rows_list,
    variants,
    device,
    timer,
    log,
    layer_cls=Layer,
    state_dtype=torch.float32,
    norm_tail=None,
) -> list[dict]:
    """`layer_cls`: this Layer or one with its constructor, step, state, state_snapshot,
    restore and norm_tail (benchmarks/kda_decode_fusion.py's KDA layer); its float32 state
    pools are narrowed to `state_dtype`; `norm_tail` goes to its fused steps."""
    results = []
    itemsize = torch.tensor([], dtype=state_dtype).element_size()
    for shape_name, (hk, hv, dk, dv, width) in shapes.items():
        for rows in rows_list:
            state_bytes = rows * hv * dk * dv * itemsize
            copies = weight_copies(state_bytes) if device.type == "cuda" else 1
            layer = layer_cls(rows, hk, hv, dk, dv, width, copies, device, seed=rows * 131 + hv)
            layer.state = [pool.to(state_dtype) for pool in layer.state]
            layer.norm_tail = norm_tail
            times = {}
            for name, variant in variants.items():
                bits_ok = same_bits(layer, variant, variant[0])
                us = timer(lambda i, v=variant, layer=layer: layer.step(i, *v), copies)
                times[name] = us
                row = dict(shape=shape_name, rows=rows, variant=name, us=us)
                row.update(state_dtype=str(layer.state[0].dtype).removeprefix("torch."))
                row.update(block_v=variant[0] or "plan", same_bits_as_three_launches=bits_ok)
                row.update(norm_tail=next(k for k, v in NORM_TAIL.items() if v is norm_tail))
                results.append(row)
                flag = "" if bits_ok else " WARN"
                log(f"RESULT {shape_name} rows={rows} {name} us={us:.2f} same_bits={bits_ok}{flag}")
            base = next(iter(times.values()))
            for name, us in times.items():
                log(f"SPEEDUP {shape_name} rows={rows} {name} vs_first={base / us:.3f}")
            layer = None  # frees its pools before the next
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return results


def main(
    argv: list[str] | None = None,
    *,
    doc: str = __doc__,
    layer_cls=Layer,
    shapes=SHAPES,
    tiny_shapes=TINY_SHAPES,
    rows=ROWS,
    tiny_rows=TINY_ROWS,
    variants=VARIANTS,
    tiny_variants=TINY_VARIANTS,
    **fields,
) -> dict:
    """The command line. The keywords let benchmarks/kda_decode_fusion.py run this same
    bench over its own layer, shapes and variants; `fields` go into the JSON as they are."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, help="JSON results")
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU interpreter)")
    parser.add_argument(
        "--state-dtype", choices=("float32", "bfloat16"), default="float32",
        help="the recurrent state pools' dtype (bfloat16: --linear-state-dtype auto)",
    )  # fmt: skip
    parser.add_argument("--rows", type=int, nargs="+", help="decode rows (default: ROWS)")
    parser.add_argument(
        "--norm-tail", choices=tuple(NORM_TAIL), default="rule",
        help="the fused steps' norm tail: the production rule (uses_norm_tail), or forced",
    )  # fmt: skip
    args = parser.parse_args(argv)
    start = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = args.tiny or device.type != "cuda"
    timer = time_graph_us if device.type == "cuda" else time_wall_us
    results = bench(
        tiny_shapes if tiny else shapes,
        args.rows or (tiny_rows if tiny else rows),
        tiny_variants if tiny else variants,
        device,
        timer,
        print,
        layer_cls,
        getattr(torch, args.state_dtype),
        NORM_TAIL[args.norm_tail],
    )
    return graph_timing.write_result(
        args.out,
        start,
        results,
        launches_per_graph=LAUNCHES_PER_GRAPH,
        replays=REPLAYS,
        **fields,
    )


if __name__ == "__main__":
    main()
