"""Launches (and, on a GPU, time) of one sparse-MoE layer's forward at batch-1 decode: the
shared expert folded into the fused MoE (issue 23) against the two-branch layer, at
Qwen3-Next's widths (hidden 2048, 512 experts, top-10, intermediate 512 for both) and
Kimi-Linear's (hidden 2304, 256 experts, top-8, intermediate 1024, one shared expert),
bfloat16, random weights. The all-reduce of TP > 1 is not in it (TP = 1).

Each layer runs with the fused-MoE plans (`--plans`): "sorted" (route sort: count and
place launches, then gate_up, down, slot sum), "pairs" (the decode plan: each route its
own block, no sort; kernels/fused_moe_triton.py) and "pairs_sum" (the pairs plan summing
each token's slots in its down launch, the default `moe_slot_sum`), forced whatever
`uses_pairs_plan` / `uses_slot_sum` would pick, at each of `--tokens` (default 1 2 4 8: the pairs plan serves T <= 4 by default, so
T = 8 shows what it would cost past its constant). The plans' outputs must be equal bit
for bit; each row records it.

How launches are counted:
  * CUDA: torch.profiler's CUDA activity over one eager forward after a warm-up; every
    device kernel counts once (Triton, cuBLAS, torch elementwise), memcpy / memset apart.
    Then one CUDA graph of `--repeats` forwards is replayed: µs per layer.
  * `--interpret` (CPU): Triton's interpreter at tiny widths with the CUDA dispatch forced
    (`use_triton` answers as on a GPU for CPU tensors, in every kvloom module); each Triton
    launch counts (`kernel[grid](...)`), and so does each torch op a GPU would run as a
    kernel (aten ops other than views and allocations, seen by a TorchDispatchMode outside
    the Triton launches).

    python benchmarks/moe_layer_launches.py [--tokens 1 2 4 8] [--plans sorted pairs pairs_sum]
        [--repeats 200] [--pairs-stages 3 4,3 6 8,4] [--shapes qwen3-next] [--out FILE.json]

`--pairs-stages` times the pairs plan once per pipelining depth (KVLOOM_MOE_DECODE_STAGES
values: "6" for both launches, "6,4" for gate_up and down), each checked bitwise against
the first plan. On CUDA each row also records each kernel's time in the eager forward
(`eager_kernel_us`): which launch the layer's time is in.
    python benchmarks/moe_layer_launches.py --interpret
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

if "--interpret" in sys.argv:  # the interpreter is chosen when triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from graph_timing import graph_time_us  # noqa: E402

from kvloom.kernels import fused_moe_triton  # noqa: E402
from kvloom.workers.layers.tp_group import LocalGroup  # noqa: E402
from kvloom.workers.models.kimi_linear import KimiMoE  # noqa: E402
from kvloom.workers.models.qwen3_next import Qwen3NextSparseMoe  # noqa: E402

SHAPES = {
    "qwen3-next": dict(kind="qwen3_next", hidden=2048, experts=512, top_k=10, inter=512),
    "kimi-linear": dict(kind="kimi", hidden=2304, experts=256, top_k=8, inter=1024),
}
TINY = dict(hidden=64, experts=8, top_k=2, inter=32)
# "pairs_sum": the pairs plan with each token's slots summed in its down launch
# (the default; KVLOOM_UNFUSED=moe_slot_sum turns it off), one launch fewer.
PLANS = ("sorted", "pairs", "pairs_sum")
# aten ops that launch nothing on a GPU (views, metadata, allocations).
NO_KERNEL = {
    "empty",
    "empty_strided",
    "empty_like",
    "view",
    "_unsafe_view",
    "t",
    "transpose",
    "split",
    "split_with_sizes",
    "slice",
    "select",
    "as_strided",
    "unsqueeze",
    "squeeze",
    "expand",
    "detach",
    "alias",
    "permute",
    "lift_fresh",
}


def build_layer(shape: dict, fold: bool, device: str) -> torch.nn.Module:
    dtype = torch.bfloat16
    if shape["kind"] == "qwen3_next":
        config = dict(
            hidden_size=shape["hidden"],
            num_experts=shape["experts"],
            num_experts_per_tok=shape["top_k"],
            moe_intermediate_size=shape["inter"],
            shared_expert_intermediate_size=shape["inter"],
            norm_topk_prob=True,
        )
        with torch.device(device):
            layer = Qwen3NextSparseMoe(config, LocalGroup(), dtype, True, fold)
    else:
        config = dict(
            hidden_size=shape["hidden"],
            num_experts=shape["experts"],
            num_experts_per_token=shape["top_k"],
            moe_intermediate_size=shape["inter"],
            num_shared_experts=1,
            routed_scaling_factor=2.446,
        )
        with torch.device(device):
            layer = KimiMoE(config, LocalGroup(), dtype, fold)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():
            scale = param.shape[-1] ** -0.5 if param.dim() > 1 else 0.1
            param.copy_(torch.randn(param.shape, generator=gen, device=device) * scale)
    return layer.eval()


class OpCounter(TorchDispatchMode):
    """Torch ops that would be GPU kernels, outside the Triton launches."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.in_triton = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.in_triton and name not in NO_KERNEL:
            self.ops.append(f"aten.{name}")
        return func(*args, **(kwargs or {}))


def force_cuda_dispatch() -> None:
    """`use_triton` answers as on a GPU for CPU tensors, wherever kvloom imported it."""
    from kvloom.kernels import dispatch

    original = dispatch.use_triton

    def forced(tensor):
        return tensor.dtype in dispatch.TRITON_DTYPES

    dispatch.use_triton = forced
    for module in list(sys.modules.values()):
        if getattr(module, "use_triton", None) is original:
            module.use_triton = forced


@contextmanager
def env_set(name: str, value: str | None):
    """`name` set to `value` inside (None: left as it is), restored after."""
    saved = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


@contextmanager
def moe_plan(plan: str, stages: str | None = None):
    """Forces the fused MoE's plan: "pairs" (no route sort), "pairs_sum" (and the slot sum
    in the down launch) or "sorted"; `stages`, the pairs plans' pipelining depths (a
    KVLOOM_MOE_DECODE_STAGES value)."""
    original = fused_moe_triton.uses_pairs_plan, fused_moe_triton.uses_slot_sum
    fused_moe_triton.uses_pairs_plan = lambda hidden, sorted_block_m: plan != "sorted"
    fused_moe_triton.uses_slot_sum = lambda hidden, pairs: pairs and plan == "pairs_sum"
    try:
        with env_set("KVLOOM_MOE_DECODE_STAGES", stages):
            yield
    finally:
        fused_moe_triton.uses_pairs_plan, fused_moe_triton.uses_slot_sum = original


def interpreted_launches(layer, x) -> list[str]:
    from triton.runtime.interpreter import InterpretedFunction

    counter = OpCounter()
    original = InterpretedFunction.__getitem__

    def counted(kernel, grid):
        launch = original(kernel, grid)

        def run(*args, **kwargs):
            counter.ops.append(f"triton.{kernel.fn.__name__}")
            counter.in_triton = True
            try:
                return launch(*args, **kwargs)
            finally:
                counter.in_triton = False

        return run

    InterpretedFunction.__getitem__ = counted
    try:
        with torch.no_grad(), counter:
            layer(x)
    finally:
        InterpretedFunction.__getitem__ = original
    return counter.ops  # in call order, Triton launches and torch ops alike


def cuda_launches(layer, x) -> tuple[list[str], list[str], list[float]]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        layer(x)  # compile and warm up
    torch.cuda.synchronize()
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        layer(x)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    copies = [e.name for e in events if e.name.startswith(("Memcpy", "Memset"))]
    kernels = [e for e in events if e.name not in copies]
    # Each kernel's time in the eager forward (µs): which launch the layer's time is in.
    times = [round(e.time_range.elapsed_us(), 2) for e in kernels]
    return [e.name for e in kernels], copies, times


def graph_us(layer, x, repeats: int) -> float:
    """µs per layer call in a CUDA graph, the best of 5 replays."""
    return graph_time_us(lambda: layer(x), repeats, replays=5)


def measure(layer, x, cuda: bool, repeats: int) -> dict:
    """One layer at one plan: its launches (and, on CUDA, µs per layer in a graph)."""
    if cuda:
        kernels, copies, times = cuda_launches(layer, x)
        row = dict(kernels=kernels, copies=copies, eager_kernel_us=times)
        row["us_per_layer"] = graph_us(layer, x, repeats)
    else:
        row = dict(kernels=interpreted_launches(layer, x))
    row["launches"] = len(row["kernels"])
    with torch.no_grad():
        row["output"] = layer(x)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--plans", nargs="+", choices=PLANS, default=list(PLANS))
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--pairs-stages", nargs="+", default=[None], help="e.g. 3 6 8,4")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--interpret", action="store_true", help="CPU, tiny widths")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cuda = not args.interpret
    if cuda and not torch.cuda.is_available():
        sys.exit("no CUDA device: pass --interpret to count on the CPU")
    if args.interpret:
        force_cuda_dispatch()
    device = "cuda" if cuda else "cpu"
    results = []
    runs = [
        (plan, stages)
        for plan in args.plans
        for stages in (args.pairs_stages if plan != "sorted" else [None])
    ]
    for name in args.shapes:
        full = SHAPES[name]
        shape = {**full, **TINY} if args.interpret else full
        for fold in (False, True):
            layer = build_layer(shape, fold, device)
            for tokens in args.tokens:
                gen = torch.Generator(device=device).manual_seed(tokens)
                x = torch.randn(tokens, shape["hidden"], generator=gen, device=device)
                x = x.to(torch.bfloat16)
                first = None
                for plan, stages in runs:
                    row = dict(model=name, folded=fold, tokens=tokens, plan=plan, **shape)
                    row["pairs_stages"] = stages
                    started = time.perf_counter()
                    with moe_plan(plan, stages):
                        row.update(measure(layer, x, cuda, args.repeats))
                    output = row.pop("output")
                    first = output if first is None else first
                    row["bitwise_as_first_plan"] = torch.equal(output, first)
                    row["seconds"] = round(time.perf_counter() - started, 2)
                    results.append(row)
                    timing = f", {row['us_per_layer']:.2f} us/layer (graph)" if cuda else ""
                    print(
                        f"{name:12s} {'folded' if fold else 'two-branch':10s} T={tokens:<3d} "
                        f"{plan:9s} {stages or '':5s} {row['launches']:2d} launches{timing}, "
                        f"bitwise={row['bitwise_as_first_plan']}: {', '.join(row['kernels'])}"
                    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name() if cuda else "cpu (interpreted)",
                    "results": results,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
