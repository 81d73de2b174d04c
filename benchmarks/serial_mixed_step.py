"""Times the serial linear-attention kernels of a mixed step (`KVLOOM_KDA_MIXED_STEPS` /
`KVLOOM_GDN_MIXED_STEPS` auto or serial): the token-by-token causal conv and recurrence
(`batch_invariant_triton.serial_causal_conv1d_triton`, `serial_gated_delta_rule_triton`)
over one layer's rows: `--decode-rows` rows of one token and `--prefill-rows` rows of
`--prefill-tokens` tokens, as Kimi-Linear-16l's offline mixed steps have them (about 126
decodes beside one or two prompt chunks of a few hundred tokens; gpu_fast_path.md,
twenty-eighth session). A long row is a chain of dependent token steps, so the step's time
is its longest row's latency, not its bytes.

    python3 benchmarks/serial_mixed_step.py --out $OUT/serial_mixed_step.json
    python3 benchmarks/serial_mixed_step.py --shape qwen3-next --prefill-tokens 128 1024

Each (shape, prefill length) reports µs a layer for the conv (`conv_us`: the serial loop
the deterministic mode keeps; `conv_parallel_us`: the token-parallel form the default
mode's mixed steps run, and whether its bits are the loop's) and for the recurrence (the
default mode's form: `SERIAL_WARPS` warps), from CUDA events over REPEATS eager
calls after a warm-up (each launch runs long enough that launch overhead is noise), and a
SHA-256 of the serial loop's and the recurrence's outputs and states, so two trees can be
compared for the same bits. Without CUDA (or with --tiny) it runs a small shape in
Triton's CPU interpreter: that only exercises the script.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import time
from functools import partial
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before triton is imported: it reads this once
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvloom.kernels.batch_invariant_triton import (  # noqa: E402
    serial_causal_conv1d_triton,
    serial_gated_delta_rule_triton,
)
from kvloom.kernels.l2norm import l2norm  # noqa: E402

# name -> (key heads, value heads, head dim, per-channel decay (KDA), conv channels)
SHAPES = {
    "kimi-linear": (32, 32, 128, True, 3 * 32 * 128),
    "qwen3-next": (16, 32, 128, False, 2 * 16 * 128 + 32 * 128),
}
TINY_SHAPES = {"tiny": (2, 4, 16, True, 3 * 2 * 16 + 16)}
CONV_WIDTH = 4
REPEATS = 20


def make_step(shape, decode_rows, prefill_rows, prefill_tokens, state_dtype, device, seed):
    """One layer's mixed-step inputs: prefill rows first (fresh, no state), then decodes
    (their own random state), each row its own slot."""
    hk, hv, dim, kda, channels = shape
    gen = torch.Generator().manual_seed(seed)
    lengths = [prefill_tokens] * prefill_rows + [1] * decode_rows
    tokens, rows = sum(lengths), len(lengths)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=gen) * scale).to(device)

    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    has_state = torch.tensor([False] * prefill_rows + [True] * decode_rows, device=device)
    gate = (hv, dim) if kda else (hv,)
    return dict(
        x=randn(tokens, channels).bfloat16(),
        weight=randn(channels, CONV_WIDTH, scale=0.5).bfloat16(),
        conv_state=randn(rows, channels, CONV_WIDTH - 1).bfloat16(),
        q=randn(tokens, hk, dim).bfloat16(),
        k=randn(tokens, hk, dim).bfloat16(),
        v=randn(tokens, hv, dim).bfloat16(),
        g=-torch.rand(tokens, *gate, generator=gen).to(device) * 0.1,
        beta=torch.rand(tokens, hv, generator=gen).to(device),
        state=randn(rows, hv, dim, dim, scale=0.1).to(state_dtype),
        cu=cu,
        slots=torch.arange(rows, dtype=torch.int32, device=device),
        has_state=has_state,
        kda=kda,
    )


def run_conv(step, conv_state, token_parallel=False):
    # No keyword for the serial loop: an older tree's kernels (SERIAL_OLD) lack it.
    form = {"token_parallel": True} if token_parallel else {}
    return serial_causal_conv1d_triton(
        step["x"], step["weight"], None, conv_state, step["cu"], step["slots"],
        step["has_state"], "silu", **form,
    )  # fmt: skip


def has_token_parallel_conv() -> bool:
    return "token_parallel" in inspect.signature(serial_causal_conv1d_triton).parameters


def run_recurrence(step, state, tiling=None):
    # No tiling keywords for the default: an older tree's kernels (SERIAL_OLD) lack them.
    tiled = {} if tiling is None else dict(block_v=tiling[0], num_warps=tiling[1])
    return serial_gated_delta_rule_triton(
        step["q"], step["k"], step["v"], step["g"], step["beta"], state, step["cu"],
        step["slots"], step["has_state"], None, True, per_channel_decay=step["kda"],
        round_every_token=False, **tiled,
    )  # fmt: skip


def run_prenormed_recurrence(step, state):
    """The recurrence with q and k normalised beforehand (float32, torch) and the kernel's
    own norms off: whether two per-token reductions leave the chain of a long row."""
    q, k = l2norm(step["q"].float()), l2norm(step["k"].float())
    return serial_gated_delta_rule_triton(
        q, k, step["v"], step["g"], step["beta"], state, step["cu"], step["slots"],
        step["has_state"], None, False, per_channel_decay=step["kda"], round_every_token=False,
    )  # fmt: skip


def parse_tiling(text: str) -> tuple[int, int]:
    """'BVxWARPS', e.g. '16x2': the recurrence's state columns a program and warps."""
    block_v, _, warps = text.partition("x")
    return int(block_v), int(warps)


def time_us(fn, repeats: int) -> float:
    fn()  # compile and warm up
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) * 1000 / repeats


def digest(*tensors: torch.Tensor) -> str:
    sha = hashlib.sha256()
    for t in tensors:
        sha.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()[:16]


def time_variant(step, run, out, repeats) -> tuple[float, float]:
    """A recurrence variant's µs on a scratch pool and its largest difference from `out`
    (the prenormed kernel writes q's dtype, float32 here: compared in the default's)."""
    variant_out = run(step, step["state"].clone())
    us = time_us(partial(run, step, step["state"].clone()), repeats)
    return round(us, 1), float((variant_out.to(out.dtype).float() - out.float()).abs().max())


def bench(
    shape_name, shape, decode_rows, prefill_rows, prefill_tokens, state_dtype, repeats,
    tilings=(), prenorm=False,
):  # fmt: skip
    device = "cuda" if torch.cuda.is_available() else "cpu"
    step = make_step(
        shape, decode_rows, prefill_rows, prefill_tokens, state_dtype, device, seed=prefill_tokens
    )
    # Outputs from the inputs as made (the timed calls then run on scratch pools).
    conv_state, state = step["conv_state"].clone(), step["state"].clone()
    conv_out, out = run_conv(step, conv_state), run_recurrence(step, state)
    bits = digest(conv_out, conv_state, out, state)
    conv_pool, pool = step["conv_state"].clone(), step["state"].clone()
    parallel = {}
    if has_token_parallel_conv():  # the default mode's conv beside the serial loop
        par_state = step["conv_state"].clone()
        par_out = run_conv(step, par_state, token_parallel=True)
        par_pool = step["conv_state"].clone()
        parallel = dict(
            conv_parallel_us=round(time_us(partial(run_conv, step, par_pool, True), repeats), 1),
            conv_parallel_same_bits=torch.equal(par_out, conv_out)
            and torch.equal(par_state, conv_state),
        )
    if prenorm:
        us, diff = time_variant(step, run_prenormed_recurrence, out, repeats)
        parallel.update(recurrence_prenorm_us=us, prenorm_max_abs_diff=diff)
    by_tiling = {}
    for text in tilings:  # other tilings: their time and bits (the default's are above)
        tiling, tiled_state = parse_tiling(text), step["state"].clone()
        tiled_out = run_recurrence(step, tiled_state, tiling)
        us = time_us(partial(run_recurrence, step, step["state"].clone(), tiling), repeats)
        by_tiling[text] = dict(
            recurrence_us=round(us, 1),
            sha256=digest(conv_out, conv_state, tiled_out, tiled_state),
            max_abs_diff=float((tiled_out.float() - out.float()).abs().max()),
        )
    return dict(
        shape=shape_name,
        decode_rows=decode_rows,
        prefill_rows=prefill_rows,
        prefill_tokens=prefill_tokens,
        state_dtype=str(state_dtype).removeprefix("torch."),
        conv_us=round(time_us(lambda: run_conv(step, conv_pool), repeats), 1),
        recurrence_us=round(time_us(lambda: run_recurrence(step, pool), repeats), 1),
        **parallel,
        sha256=bits,
        **({"tilings": by_tiling} if by_tiling else {}),
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), nargs="+", default=["kimi-linear"])
    parser.add_argument("--decode-rows", type=int, default=126)
    parser.add_argument("--prefill-rows", type=int, default=2)
    parser.add_argument("--prefill-tokens", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--tilings",
        nargs="*",
        default=[],
        help="recurrence tilings BVxWARPS (e.g. 16x2) timed beside the default",
    )
    parser.add_argument(
        "--prenorm",
        action="store_true",
        help="also time the recurrence on q and k normalised beforehand (its norms off)",
    )
    parser.add_argument("--tiny", action="store_true", help="small shape (CPU interpreter)")
    parser.add_argument("--out", type=Path, help="JSON results")
    args = parser.parse_args(argv)
    tiny = args.tiny or not torch.cuda.is_available()
    shapes = TINY_SHAPES if tiny else {name: SHAPES[name] for name in args.shape}
    state_dtype = getattr(torch, args.state_dtype)
    rows = []
    for name, shape in shapes.items():
        for tokens in args.prefill_tokens:
            row = bench(
                name, shape, args.decode_rows, args.prefill_rows, tokens, state_dtype,
                1 if tiny else REPEATS, args.tilings, args.prenorm,
            )  # fmt: skip
            plain = {k: v for k, v in row.items() if k != "tilings"}
            print("RESULT", " ".join(f"{k}={v}" for k, v in plain.items()), flush=True)
            for text, tiled in row.get("tilings", {}).items():
                fields = " ".join(f"{k}={v}" for k, v in tiled.items())
                print(f"RESULT tiling={text} prefill_tokens={tokens} {fields}", flush=True)
            rows.append(row)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = dict(device=device, torch=torch.__version__, rows=rows)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
