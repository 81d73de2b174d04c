"""`kvloom quickstart`: the README's main job on the embedded default.

Writes a tiny demo model (if not there yet) and generates from it with the engine API,
batching the prompts continuously.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_DIR = Path.home() / ".cache" / "kvloom" / "demo-model"
PROMPTS = ["The quick brown fox", "Once upon a time", "def fibonacci(n):"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("quickstart", help="run kvloom end to end on a demo model")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvloom import Engine, SamplingParams
    from kvloom.cluster.demo_model import write_demo_model

    if not (args.model_dir / "config.json").is_file():
        print(f"writing a demo model to {args.model_dir}")
        write_demo_model(args.model_dir)
    engine = Engine(model=str(args.model_dir), progress=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=0)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            if out.finished:
                print(
                    f"[{out.request_id}] {PROMPTS[int(out.request_id)]!r} -> {text!r} "
                    f"({len(out.outputs[0].token_ids)} tokens, {out.outputs[0].finish_reason})"
                )
    stats = engine.stats()
    print(
        f"done: {stats['num_finished']} requests, {stats['num_steps']} steps, "
        f"free blocks {stats['num_free_blocks']}/{stats['num_blocks']}"
    )
    sys.stdout.flush()
    return 0
