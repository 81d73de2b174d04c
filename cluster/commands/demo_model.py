"""`kvloom demo-model DIR`: write a tiny random-weight checkpoint and tokenizer."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvloom.cluster import demo_model


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo-model",
        help="write a tiny random-weight Hugging Face model and tokenizer (no downloads)",
        description=(
            "Write a random-weight Hugging Face checkpoint (config.json, model.safetensors, "
            "generation_config.json) and a byte-level BPE tokenizer trained on a text shipped "
            "with kvloom (tokenizer.json, tokenizer_config.json with a ChatML chat template). "
            "The same arguments always write identical files."
        ),
    )
    parser.add_argument("dir", metavar="DIR", help="output directory (created if missing)")
    parser.add_argument("--arch", choices=demo_model.ARCHS, default="llama")
    parser.add_argument("--size", choices=demo_model.SIZES, default="tiny")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--dtype", choices=demo_model.DTYPES, default="float32")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=(
            "tokenizer and embedding size (default: "
            + ", ".join(f"{k} {v}" for k, v in demo_model.DEFAULT_VOCAB_SIZE.items())
            + f"; at least {demo_model.MIN_VOCAB_SIZE})"
        ),
    )
    parser.add_argument(
        "--tokenizer-format",
        choices=demo_model.TOKENIZER_FORMATS,
        default="tokenizers",
        help="tokenizer.json (tokenizers) or Kimi's tiktoken.model layout (tiktoken)",
    )
    parser.add_argument(
        "--tie-word-embeddings",
        action="store_true",
        help="share the input embedding with the LM head",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty DIR, replacing checkpoint and tokenizer files there",
    )
    parser.set_defaults(func=run)


def _num_parameters(weights: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(weights), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
            count = 1
            for dim in f.get_slice(name).get_shape():
                count *= dim
            total += count
    return total


def run(args: argparse.Namespace) -> int:
    try:
        out = demo_model.write_demo_model(
            args.dir,
            arch=args.arch,
            size=args.size,
            seed=args.seed,
            dtype=args.dtype,
            vocab_size=args.vocab_size,
            force=args.force,
            tie_word_embeddings=args.tie_word_embeddings,
            tokenizer_format=args.tokenizer_format,
        )
    except ValueError as e:
        print(f"kvloom demo-model: error: {e}", file=sys.stderr)
        return 2
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    params = sum(_num_parameters(p) for p in sorted(out.glob("*.safetensors")))
    print(
        f"wrote {config['architectures'][0]} ({args.size}, {args.dtype}, seed {args.seed}): "
        f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
        f"vocab {config['vocab_size']}, {params:,} parameters"
    )
    for path in sorted(out.iterdir()):
        if path.is_file():
            print(f"  {path}  ({path.stat().st_size:,} bytes)")
    print(f"note: {demo_model.RANDOM_WEIGHTS_NOTE}")
    return 0
