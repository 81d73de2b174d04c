"""Speculative decoding: acceptance and decode speed-up on a repetitive workload.

Runs the same greedy workload without speculation, with the n-gram proposer and with the
target as its own draft model (full acceptance: the upper bound of the mechanism), on one
model in one process. Reports tokens/s, acceptance rate and mean tokens per step.

    python benchmarks/spec_decode.py --arch llama --size small --out results.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
from pathlib import Path

import torch

from kvloom import Engine, SamplingParams
from kvloom.cluster.demo_model import write_demo_model


def workload(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a short phrase, as code and templated text do."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        phrase = [rng.randrange(10, 400) for _ in range(rng.randint(4, 8))]
        prompts.append((phrase * 40)[: rng.randint(96, 160)])
    return prompts


def run(engine: Engine, prompts, max_tokens: int) -> tuple[float, int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    start = time.perf_counter()
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--size", default="small")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    prompts = workload(args.requests, seed=0)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_demo_model(Path(tmp) / "m", arch=args.arch, size=args.size))
        configs = {
            "none": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": args.k},
            "self_draft": {
                "method": "draft_model",
                "draft_model": model,
                "num_speculative_tokens": args.k,
            },
        }
        for name, spec in configs.items():
            try:
                engine = Engine(
                    model=model,
                    dtype="float32",
                    progress=False,
                    speculative_config=spec,
                    max_model_len=1024,
                )
            except ValueError as err:  # e.g. a linear-attention model as its own draft
                print(f"{name}: skipped ({err})")
                continue
            run(engine, prompts[:1], 4)  # warm-up
            elapsed, tokens = run(engine, prompts, args.max_tokens)
            stats = engine.stats()
            rows[name] = {
                "seconds": round(elapsed, 3),
                "output_tokens": tokens,
                "tokens_per_s": round(tokens / elapsed, 1),
                "acceptance_rate": round(stats["spec_acceptance_rate"], 3),
                "mean_tokens_per_step": round(stats["spec_mean_accepted_length"], 2),
            }
    base = rows["none"]["tokens_per_s"]
    print("| proposer | tokens/s | speed-up | acceptance | tokens per verify step |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        accept = "-" if name == "none" else f"{r['acceptance_rate']:.1%}"
        per_step = "-" if name == "none" else f"{r['mean_tokens_per_step']:.2f}"
        print(
            f"| {name} | {r['tokens_per_s']} | {r['tokens_per_s'] / base:.2f}x | {accept} "
            f"| {per_step} |"
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"out": None},
                    "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} threads, "
                    f"torch {torch.__version__}",
                    "results": rows,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
