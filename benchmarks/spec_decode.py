"""Speculative decoding: acceptance and decode speed-up on a repetitive workload.

Runs the same greedy workload without speculation, with the n-gram proposer and with the
target as its own draft model (full acceptance: the upper bound of the mechanism), on one
model in one process. Reports tokens/s, acceptance rate and mean tokens per step.

    python benchmarks/spec_decode.py --arch llama --size small --out results.json

On a GPU, `--shape qwen3-8b` (cluster/bench.py's shapes, random dummy weights, bf16, CUDA
graphs on) runs each proposer at every `--rows` batch size and adds `draft_1layer`: a
one-layer draft of the target's widths, the cost of an MTP / EAGLE-shaped head, whose
random drafts are all rejected, so its figure is the per-step overhead, and
`draft_1layer_forced`: the same drafter with every draft accepted (rejection sampling
runs, then its result is replaced: `acceptance_forced`). From the measured
step times it reports the overhead per draft token and the break-even mean accepted length
(the tokens per verify step a drafter must reach to pay for itself):

    python benchmarks/spec_decode.py --shape qwen3-8b --rows 1 64 --out results.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import random
import tempfile
import time
from pathlib import Path

import torch

from kvloom import Engine, SamplingParams
from kvloom.cluster.demo_model import write_demo_model
from kvloom.workers import model_runner
from kvloom.workers.spec_decode.rejection_sampler import RejectionSampleOutput


def workload(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a short phrase, as code and templated text do."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        phrase = [rng.randrange(10, 400) for _ in range(rng.randint(4, 8))]
        prompts.append((phrase * 40)[: rng.randint(96, 160)])
    return prompts


def run(engine: Engine, prompts, max_tokens: int):
    """(seconds of decoding, output tokens): the clock starts once every prompt has been
    prefilled (its first token out), so the figure is decode time per token."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    started: set[str] = set()
    start = None
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            started.add(out.request_id)
            if out.finished:
                tokens += len(out.outputs[0].token_ids) - 1
        if start is None and len(started) == len(prompts):
            start = time.perf_counter()
    return time.perf_counter() - (start or time.perf_counter()), tokens


@contextlib.contextmanager
def acceptance_forced():
    """Every draft accepted: rejection sampling still runs (its cost is paid), then its
    result is replaced by the row's drafts and a bonus token. Forcing the drafts instead
    (proposing the tokens a run without speculation produced) does not survive bf16 on the
    GPU: a verification row's logits differ in rounding from a decode row's, the first
    near-tie sends the run off the recorded trajectory, and every later draft misses (3.4%
    acceptance at 1 row, 1.8% at 64 rows, H200 2026-12-02)."""
    real = model_runner.rejection_sample

    def accept_all(target_logits, draft_token_ids, num_draft_tokens, rows, draft_probs=None):
        result = real(target_logits, draft_token_ids, num_draft_tokens, rows, draft_probs)
        bonus = result.token_ids[:, :1]  # a valid id; with random weights any token does
        return RejectionSampleOutput(
            token_ids=torch.cat([draft_token_ids.to(bonus), bonus], dim=1),
            num_accepted=torch.as_tensor(num_draft_tokens, device=bonus.device).long(),
            invalid=result.invalid,
        )

    model_runner.rejection_sample = accept_all
    try:
        yield
    finally:
        model_runner.rejection_sample = real


def gpu_main(args) -> None:
    """Real shapes on the GPU: ms per output token by proposer and batch size."""
    from kvloom.cluster.bench import SHAPES, shape_dir

    rows: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(shape_dir(args.shape, Path(tmp)))
        one_layer = Path(tmp) / "one_layer"
        one_layer.mkdir()
        config = dict(SHAPES[args.shape], num_hidden_layers=1)
        (one_layer / "config.json").write_text(json.dumps(config))
        k = args.k
        configs = {
            "none": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": k},
            "self_draft": {"method": "draft_model", "model": model, "num_speculative_tokens": k},
            "draft_1layer": {
                "method": "draft_model",
                "model": str(one_layer),
                "num_speculative_tokens": k,
            },
        }
        # The MTP / EAGLE-shaped drafter with acceptance forced (acceptance_forced).
        configs["draft_1layer_forced"] = configs["draft_1layer"]
        for name, spec in configs.items():
            if args.proposers and name not in args.proposers:
                continue
            engine = Engine(
                model=model,
                dtype=args.dtype,
                load_format="dummy",
                progress=False,
                speculative_config=spec,
                max_model_len=1024,
                max_num_seqs=max(args.rows),
            )
            run(engine, workload(1, seed=1), 8)  # warm-up
            for batch in args.rows:
                forced = name == "draft_1layer_forced"
                with acceptance_forced() if forced else contextlib.nullcontext():
                    elapsed, tokens = run(engine, workload(batch, seed=batch), args.max_tokens)
                stats = engine.stats()  # acceptance: cumulative over this engine's runs
                rows[f"{name}@{batch}"] = {
                    "proposer": name,
                    "rows": batch,
                    "ms_per_token": round(elapsed * 1e3 / (tokens / batch), 3),
                    "output_tokens_per_s": round(tokens / elapsed, 1),
                    "acceptance_rate": round(stats.get("spec_acceptance_rate", 0.0), 3),
                    "mean_tokens_per_step": round(stats.get("spec_mean_accepted_length", 1.0), 2),
                }
                print(json.dumps(rows[f"{name}@{batch}"]))
            del engine
    for batch in args.rows:
        needed = [f"{name}@{batch}" for name in ("none", "draft_1layer", "draft_1layer_forced")]
        if not all(key in rows for key in needed):
            continue  # --proposers left out a figure the derived ones need
        base = rows[f"none@{batch}"]["ms_per_token"]
        # draft_1layer's drafts are rejected: each of its steps emits one token, so its ms
        # per token is the cost of one drafting + verify step with k drafts.
        step = (
            rows[f"draft_1layer@{batch}"]["ms_per_token"]
            * rows[f"draft_1layer@{batch}"]["mean_tokens_per_step"]
        )
        forced = rows[f"draft_1layer_forced@{batch}"]
        rows[f"derived@{batch}"] = {
            "rows": batch,
            "plain_step_ms": base,
            "speculative_step_ms_1layer_draft": round(step, 3),
            "overhead_ms_per_draft_token": round((step - base) / k, 3),
            "break_even_tokens_per_step": round(step / base, 2),
            "forced_speed_up": round(base / forced["ms_per_token"], 3),
        }
        print(json.dumps(rows[f"derived@{batch}"]))
    if args.out:
        args.out.write_text(
            json.dumps({"args": vars(args) | {"out": None}, "results": rows}, indent=2)
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--size", default="small")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--shape", help="GPU mode: a cluster/bench.py shape (dummy weights)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--proposers", nargs="+", help="GPU mode: run only these")
    args = parser.parse_args()
    if args.shape:
        if args.max_tokens == 64:
            args.max_tokens = 128
        return gpu_main(args)
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
