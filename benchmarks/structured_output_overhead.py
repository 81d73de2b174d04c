"""Structured-output overhead per step, beside unconstrained sampling (issue 20).

For a batch of B requests, each with its own matcher on one JSON schema, one step costs:
  build: the scheduler's host work, every matcher's next-token bitmask (as bytes),
  apply: the sampler's mask application (host->device copy, unpack, masked fill),
  sample: the whole greedy sampling call with the masks, beside the same call without.
The vocabulary is synthetic, Qwen3-sized (151,936 tokens), so the mask work is a real
model's; the matchers walk the grammar by taking a random allowed token each step.

    python benchmarks/structured_output_overhead.py --device cuda --out result.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import time

import numpy as np
import torch
import xgrammar

from kvloom.cluster.structured_outputs import RequestGrammar
from kvloom.contracts.sampling_params import SamplingParams
from kvloom.workers.sampler import RowSamplingState, apply_token_bitmasks, sample_on_device

VOCAB = 151_936
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "pet": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
            "required": ["kind", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "pet"],
    "additionalProperties": False,
}


def synthetic_vocab(size: int, seed: int = 0) -> list[str]:
    """Every printable character, then distinct random 2..6-character pieces of JSON-ish
    text (letters, digits, quotes, braces, spaces), and a stop token last."""
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + ' "{}[],:.-_'
    vocab = list(dict.fromkeys(string.printable))
    seen = set(vocab)
    while len(vocab) < size - 1:
        piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 6)))
        if piece not in seen:
            seen.add(piece)
            vocab.append(piece)
    return vocab + ["<|eos|>"]


def timed(sync, fn, *args):
    """(seconds, result) of fn(*args), the device synchronised on both sides."""
    sync()
    start = time.perf_counter()
    result = fn(*args)
    sync()
    return time.perf_counter() - start, result


def build_masks(grammars: list[RequestGrammar]) -> list[bytes]:
    return [g.next_token_bitmask() for g in grammars]


def run(batch: int, steps: int, device: torch.device, compiled, rng: random.Random) -> dict:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    grammars = [RequestGrammar(compiled, VOCAB) for _ in range(batch)]
    params = SamplingParams(temperature=0.0)
    logits = torch.randn(batch, VOCAB, device=device)
    build, apply, masked, plain = [], [], [], []
    for _ in range(steps):
        seconds, masks = timed(sync, build_masks, grammars)
        build.append(seconds)
        rows = [RowSamplingState(params, 0, [], [], token_bitmask=m) for m in masks]
        free_rows = [RowSamplingState(params, 0, [], []) for _ in masks]
        apply.append(timed(sync, apply_token_bitmasks, logits.clone(), rows)[0])
        masked.append(timed(sync, sample_on_device, logits, rows, -1)[0])
        plain.append(timed(sync, sample_on_device, logits, free_rows, -1)[0])
        for grammar, mask in zip(grammars, masks):  # walk on: a random allowed token
            words = np.frombuffer(mask, dtype=np.uint32)
            bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:VOCAB]
            allowed = np.flatnonzero(bits)
            if grammar.terminated or not len(allowed):
                grammar.matcher.reset()
                continue
            grammar.accept(int(allowed[rng.randrange(len(allowed))]))

    def ms(values):  # median, the first (warm-up) step left out
        return round(statistics.median(values[1:]) * 1e3, 3)

    return {
        "batch": batch,
        "steps": steps,
        "build_ms": ms(build),
        "apply_ms": ms(apply),
        "sample_masked_ms": ms(masked),
        "sample_unconstrained_ms": ms(plain),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", default="1,256")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device(args.device)
    info = xgrammar.TokenizerInfo(
        synthetic_vocab(VOCAB), xgrammar.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[VOCAB - 1]
    )
    start = time.perf_counter()
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(SCHEMA, any_whitespace=False)
    compile_s = time.perf_counter() - start
    rng = random.Random(0)
    results = [run(int(b), args.steps, device, compiled, rng) for b in args.batches.split(",")]
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "vocab": VOCAB,
        "compile_s": round(compile_s, 3),
        "results": results,
    }
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
