"""One GPU lease, one script: correctness of the GPU path and the NCCL grid, plus figures.

- bf16 greedy tokens at TP=1 and TP=2 (Ray executor, NCCL) on a small model with real
  logit margins; also DCP=2 if two GPUs are there.
- the GPU path (fp32) against the CPU reference path on tiny dense and hybrid models.
- offline throughput of a small model at TP=1 and TP=2.

Writes JSON to --out and prints `RESULT key value` lines.

    python benchmarks/gpu_check.py --assets .gpu_assets --out $OUT/gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from kvloom import Engine, SamplingParams

PROMPTS = [[5 + (i * 37 + j * 11) % 500 for j in range(n)] for i, n in enumerate([1, 7, 33, 50])]


def first_divergence(ref, outs) -> list:
    """(row, step, reference top-2 logprob margin there) for rows whose tokens differ."""
    found = []
    for row, (a, b) in enumerate(zip(ref, outs)):
        if a.token_ids != b.token_ids:
            step = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
            top = sorted((lp.logprob for lp in a.logprobs[step].values()), reverse=True)
            found.append((row, step, round(top[0] - top[1], 4)))
    return found


def run_outputs(engine: Engine, prompts, params):
    ids = []
    for p in prompts:
        rid = engine.next_request_id()
        engine.add_request(rid, {"prompt_token_ids": p}, params)
        ids.append(rid)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [done[r] for r in ids]


def run(engine: Engine, prompts, params) -> list[list[int]]:
    ids = []
    for p in prompts:
        rid = engine.next_request_id()
        engine.add_request(rid, {"prompt_token_ids": p}, params)
        ids.append(rid)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[r] for r in ids]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def record(results: dict, key: str, value) -> None:
    results[key] = value
    print(f"RESULT {key} {value}", flush=True)


def grid_equality(results, model: str, gpus: int) -> None:
    ref = None
    for tp, dcp in [(1, 1), (2, 1), (1, 2)]:
        if tp * dcp > gpus:
            continue
        start = time.perf_counter()
        eng = Engine(
            model=model,
            dtype="bfloat16",
            progress=False,
            tensor_parallel_size=tp,
            decode_context_parallel_size=dcp,
            executor="ray",
            device="cuda",
        )
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
        outs = run_outputs(eng, PROMPTS, params)
        eng.shutdown()
        ref = ref or outs
        same = [o.token_ids for o in outs] == [o.token_ids for o in ref]
        record(results, f"bf16_tp{tp}_dcp{dcp}_same_tokens_as_tp1", same)
        if not same:
            record(
                results,
                f"bf16_tp{tp}_dcp{dcp}_divergence_row_step_margin",
                first_divergence(ref, outs),
            )
        record(results, f"bf16_tp{tp}_dcp{dcp}_wall_s", round(time.perf_counter() - start, 2))


def gpu_vs_cpu(results, name: str, model: str) -> None:
    cpu = run(
        Engine(model=model, dtype="float32", progress=False, device="cpu"), PROMPTS, greedy(16)
    )
    gpu_engine = Engine(model=model, dtype="float32", progress=False, device="cuda")
    gpu = run(gpu_engine, PROMPTS, greedy(16))
    record(results, f"{name}_fp32_gpu_equals_cpu", gpu == cpu)


def throughput(results, model: str, tp: int, num_requests: int) -> None:
    rng = random.Random(0)
    prompts = [
        [rng.randrange(10, 500) for _ in range(rng.randint(64, 256))] for _ in range(num_requests)
    ]
    eng = Engine(
        model=model,
        dtype="bfloat16",
        progress=False,
        tensor_parallel_size=tp,
        executor="ray" if tp > 1 else "inprocess",
        device="cuda",
        max_num_seqs=64,
        max_num_batched_tokens=4096,
    )
    run(eng, prompts[:2], greedy(4))  # warm-up
    start = time.perf_counter()
    outs = run(eng, prompts, greedy(64))
    elapsed = time.perf_counter() - start
    eng.shutdown()
    out_tokens = sum(len(o) for o in outs)
    total = out_tokens + sum(len(p) for p in prompts)
    record(results, f"throughput_tp{tp}_requests", num_requests)
    record(results, f"throughput_tp{tp}_s", round(elapsed, 3))
    record(results, f"throughput_tp{tp}_output_tok_s", round(out_tokens / elapsed, 1))
    record(results, f"throughput_tp{tp}_total_tok_s", round(total / elapsed, 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--assets", type=Path, required=True)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--sections", nargs="*", help="run only these (e.g. grid dense)")
    args = parser.parse_args()
    results: dict = {
        "device": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
    }
    print(results, flush=True)
    sections = [
        ("grid", lambda: grid_equality(results, str(args.assets / "qwen2-wide"), results["gpus"])),
        ("dense", lambda: gpu_vs_cpu(results, "dense", str(args.assets / "qwen3-tiny"))),
        (
            "qwen3_next",
            lambda: gpu_vs_cpu(results, "qwen3_next", str(args.assets / "qwen3_next-tiny")),
        ),
        ("kimi", lambda: gpu_vs_cpu(results, "kimi_linear", str(args.assets / "kimi_linear-tiny"))),
    ]
    for tp in (1, 2):
        if tp <= results["gpus"]:
            sections.append(
                (
                    f"tput{tp}",
                    lambda tp=tp: throughput(
                        results, str(args.assets / "qwen2-wide"), tp, num_requests=64
                    ),
                )
            )
    for name, section in sections:
        if args.sections and name not in args.sections:
            continue
        try:
            section()
        except Exception as err:  # keep going: one lease, every figure we can get
            record(results, f"{name}_error", f"{type(err).__name__}: {err}"[:300])
        if args.out:
            args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
