"""vLLM's side of the multi-turn prefix-cache replay (issue 17), on the GPU machine.

The workload of `multi_turn_replay.py` (the same seeded draws: a shared system prompt,
user text per conversation, each turn = the previous prompt + its output + new user
text; conversations of one turn submitted together) through vLLM's offline `LLM` with
prefix caching on, on a Qwen3-Next-shaped config with random ("dummy") weights. Reports
per turn the prompt tokens, vLLM's `num_cached_tokens` and the turn's wall time. Needs
only vLLM (the peer kit's install, ../shared/tools/peer-vllm): no kvloom import.

    python3 benchmarks/peer_vllm_multi_turn.py --config CONFIG.json --system-tokens 200 \
        --user-tokens 400 --turns 9 --conversations 2 --out $OUT/vllm_multi_turn.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path


def make_llm(model_dir: str, args):
    from vllm import LLM

    kwargs = dict(
        model=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        gpu_memory_utilization=0.6,
        max_model_len=args.max_model_len,
        enable_prefix_caching=True,
        seed=0,
        gdn_prefill_backend="triton",  # flashinfer is not carried by the peer kit
    )
    # vLLM keeps Mamba/GDN state for prefix hits only in its "align" cache mode.
    for extra in ({"mamba_cache_mode": "align"}, {}):
        try:
            return LLM(**kwargs, **extra), extra
        except (TypeError, ValueError) as err:
            print(f"LLM({extra}) refused: {str(err)[:300]}", flush=True)
    raise SystemExit("vLLM refused every prefix-caching configuration")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a config.json (Qwen3-Next shape)")
    parser.add_argument("--conversations", type=int, default=2)
    parser.add_argument("--turns", type=int, default=9)
    parser.add_argument("--system-tokens", type=int, default=200)
    parser.add_argument("--user-tokens", type=int, default=400)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from vllm import SamplingParams

    config = json.loads(Path(args.config).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        t0 = time.perf_counter()
        llm, extra = make_llm(tmp, args)
        startup = time.perf_counter() - t0
        vocab = int(config["vocab_size"])
        # The draws of multi_turn_replay.run, in its order.
        rng = random.Random(args.seed)
        system = [rng.randrange(10, vocab - 10) for _ in range(args.system_tokens)]
        prompts = [
            system + [rng.randrange(10, vocab - 10) for _ in range(args.user_tokens)]
            for _ in range(args.conversations)
        ]
        params = SamplingParams(
            max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True, detokenize=False
        )
        llm.generate([{"prompt_token_ids": [11] * 64}], SamplingParams(max_tokens=2))  # warm-up
        turns = []
        for turn in range(args.turns):
            start = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            wall = time.perf_counter() - start
            prompt_tokens = sum(len(p) for p in prompts)
            hit = sum(int(o.num_cached_tokens or 0) for o in outs)
            row = {
                "turn": turn + 1,
                "prompt_tokens": prompt_tokens,
                "hit_tokens": hit,
                "hit_rate": round(hit / prompt_tokens, 4),
                "turn_wall_s": round(wall, 4),
            }
            turns.append(row)
            print("RESULT", json.dumps(row), flush=True)
            prompts = [
                p
                + list(o.outputs[0].token_ids)
                + [rng.randrange(10, vocab - 10) for _ in range(args.user_tokens)]
                for p, o in zip(prompts, outs)
            ]
        block_size = getattr(llm.llm_engine.vllm_config.cache_config, "block_size", None)
    import vllm

    report = {
        "engine": f"vllm {vllm.__version__}",
        "options": {"enable_prefix_caching": True, **extra},
        "attention_block_size": block_size,
        "startup_s": round(startup, 1),
        "args": vars(args) | {"out": None},
        "turns": turns,
        "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
    }
    print(f"RESULT vllm_block_size {block_size} options {extra}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
