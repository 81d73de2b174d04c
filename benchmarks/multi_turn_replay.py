"""Multi-turn prefix-cache replay: tokens per turn, hit rate and time to first token, with
prefix caching on and off, on one model in one run.

Turn k's prompt is turn k-1's prompt + its output + new user text; conversations are
interleaved (all conversations' turn k run together). Writes JSON (--out) and prints a
markdown table.

    python benchmarks/multi_turn_replay.py --arch llama --size small --out results.json
    python benchmarks/multi_turn_replay.py --model QWEN3_NEXT_DIR --system-tokens 200 \
        --user-tokens 400 --turns 9 --conversations 2    # hybrid prompts of 200-4000 tokens

On a GPU, `--model` may be a config-only directory with `--load-format dummy --dtype
bfloat16`; benchmarks/peer_vllm_multi_turn.py replays the same workload through vLLM.
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


def run(engine: Engine, args) -> list[dict]:
    rng = random.Random(args.seed)
    vocab = engine.vocab_size
    system = [rng.randrange(10, vocab - 10) for _ in range(args.system_tokens)]
    prompts = [
        system + [rng.randrange(10, vocab - 10) for _ in range(args.user_tokens)]
        for _ in range(args.conversations)
    ]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    turns = []
    for turn in range(args.turns):
        start = {}
        first_token = {}
        outputs = {}
        hits_before = engine.stats()["prefix_cache_hit_tokens"]
        for i, prompt in enumerate(prompts):
            rid = f"t{turn}-c{i}"
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            start[rid] = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                first_token.setdefault(out.request_id, now - start[out.request_id])
                if out.finished:
                    outputs[out.request_id] = out
        ordered = [outputs[f"t{turn}-c{i}"] for i in range(len(prompts))]
        prompt_tokens = sum(len(p) for p in prompts)
        hit = engine.stats()["prefix_cache_hit_tokens"] - hits_before
        wall = time.perf_counter() - min(start.values())
        ttfts = sorted(first_token.values())
        turns.append(
            {
                "turn": turn + 1,
                "prompt_tokens": prompt_tokens,
                "hit_tokens": hit,
                "hit_rate": hit / prompt_tokens,
                "ttft_mean_s": sum(ttfts) / len(ttfts),
                "ttft_max_s": ttfts[-1],
                "turn_wall_s": wall,
                "outputs": [o.outputs[0].token_ids for o in ordered],
            }
        )
        prompts = [
            p
            + o.outputs[0].token_ids
            + [rng.randrange(10, vocab - 10) for _ in range(args.user_tokens)]
            for p, o in zip(prompts, ordered)
        ]
    return turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint dir (default: a demo model)")
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--size", default="small")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system-tokens", type=int, default=384)
    parser.add_argument("--user-tokens", type=int, default=48)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument(
        "--block-size", type=int, default=None, help="default: the engine's (16, hybrids too)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="default: the model's own positions"
    )
    parser.add_argument(
        "--load-format",
        default="safetensors",
        help="dummy: random weights for a config-only --model",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(write_demo_model(Path(tmp) / "m", arch=args.arch, size=args.size))
        results = {}
        for caching in (True, False):
            engine = Engine(
                model=model,
                dtype=args.dtype,
                progress=False,
                block_size=args.block_size,
                enable_prefix_caching=caching,
                max_model_len=args.max_model_len,
                load_format=args.load_format,
            )
            # Warm-up (first-call costs) outside the timed turns.
            engine.add_request(
                "warmup", {"prompt_token_ids": [11] * 64}, SamplingParams(max_tokens=2)
            )
            while engine.has_unfinished_requests():
                engine.step()
            results["on" if caching else "off"] = run(engine, args)
    same = all(a["outputs"] == b["outputs"] for a, b in zip(results["on"], results["off"]))
    report = {
        "command": "python benchmarks/multi_turn_replay.py "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if v is not None and k != "out"
        ),
        "machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}",
        "outputs_identical_on_off": same,
        "turns": {
            k: [{kk: vv for kk, vv in t.items() if kk != "outputs"} for t in v]
            for k, v in results.items()
        },
    }
    print("| turn | prompt tokens | hit tokens (on) | hit rate | TTFT on (s) | TTFT off (s) |")
    print("|---|---|---|---|---|---|")
    for on, off in zip(results["on"], results["off"]):
        print(
            f"| {on['turn']} | {on['prompt_tokens']} | {on['hit_tokens']} | {on['hit_rate']:.1%} "
            f"| {on['ttft_mean_s']:.3f} | {off['ttft_mean_s']:.3f} |"
        )
    print(f"outputs identical with caching on and off: {same}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
