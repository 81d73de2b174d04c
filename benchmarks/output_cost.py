"""Host time per step spent on the output path, at many running requests (issue 19).

What is timed (this thread's CPU time, so other processes on a busy machine count little;
wall time is reported beside it), per engine step, for every running request that got one new token: making
the engine's output, detokenizing, matching stop strings, logprob bookkeeping, and preparing
the front door's stream message (the gRPC responder's protobuf; the HTTP door converts those
same messages). With `--channel`, also what crosses from a scheduler actor to the front
door (msgpack encode + decode of the step's Events) as `kvloom serve` on Ray does.

No model runs: a stand-in scheduler appends one random token per request per step (its own
time is measured and subtracted), so only the output path is left. The engine code is the
real one of the tree under test, so the same script measures a checkout before and after a
change to it:

    python benchmarks/output_cost.py --out /tmp/after.json
    python benchmarks/output_cost.py --tree /tmp/before-checkout --out /tmp/before.json

`--tree DIR` imports kvloom from DIR (a plain source tree, e.g. `git archive HEAD | tar -x
-C DIR`) instead of the installed package. Both designs are handled: the old one (the engine
builds cumulative RequestOutputs; the front door diffs them into deltas and holds back stop
strings) and the one-output-path one (the engine core emits token deltas; one output
processor makes the text and the stream's deltas).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

PACKAGES = ("cluster", "contracts", "kernels", "protos", "workers")


def use_tree(tree: Path) -> None:
    """Makes `import kvloom` load `tree` (its folders mapped under kvloom as the installed
    package maps them) ahead of the installed editable package."""
    root = Path(tempfile.mkdtemp(prefix="kvloom-tree-"))
    package = root / "kvloom"
    package.mkdir()
    for entry in (tree / "kvloom").iterdir():
        (package / entry.name).symlink_to(entry)
    for name in PACKAGES:
        (package / name).symlink_to(tree / name)
    sys.path.insert(0, str(root))


class StandInScheduler:
    """`update_from_output` of a decode step: one token for each running request."""

    def __init__(self, requests, rng: random.Random, vocab_size: int) -> None:
        self.requests = requests
        self.rng = rng
        self.vocab_size = vocab_size
        self.seconds = 0.0

    def update_from_output(self, sched, runner_out):
        start = time.thread_time()
        now = time.monotonic()
        for request in self.requests:
            request.append_output_token(runner_out.sampled[request.request_id], now)
        self.seconds += time.thread_time() - start
        return list(self.requests), []

    def finish_request(self, request_id, status):  # a stop string (never matched here)
        raise AssertionError("no stop string should match in this benchmark")


class Design:
    """The tree's output path, driven one step at a time."""

    def __init__(self, kvloom_modules, tokenizer, requests, scheduler, stream: bool) -> None:
        self.m = kvloom_modules
        self.requests = requests
        self.scheduler = scheduler
        self.stream = stream
        texts = self.m.responses.TokenTexts(
            lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
        )
        self.one_path = self.m.engine_core is not None
        if self.one_path:
            core = object.__new__(self.m.engine_core.EngineCore)
            core.scheduler = scheduler
            core._emitted = {r.request_id: 0 for r in requests}
            core.num_finished = 0
            self.core = core
            # As the front door's AsyncEngine sets it (Engine.stream_only): deltas only.
            self.processor = self.m.output_processor.OutputProcessor(tokenizer, keep_history=False)
            for r in requests:
                self.processor.add_request(
                    r.request_id, r.prompt_token_ids, r.sampling_params, r.prompt
                )
        else:
            engine = object.__new__(self.m.engine.Engine)
            engine.scheduler = scheduler
            engine.outputs = self.m.output_processor.OutputProcessor(tokenizer)
            engine.num_finished = 0
            for r in requests:
                engine.outputs.add(r)
            self.engine = engine
            if stream:
                self.encoder = self.m.engine_channel.OutputEncoder()
                self.decoder = self.m.engine_channel.OutputDecoder()
                for r in requests:
                    self.decoder.start(r.request_id, list(r.prompt_token_ids))
        self.responders = {}
        for r in requests:
            params = r.sampling_params
            cls = self.m.responses.GenerateResponder
            if self.one_path:
                self.responders[r.request_id] = cls(r.request_id, params.logprobs, texts)
            else:
                self.responders[r.request_id] = cls(
                    r.request_id, params.stop, params.logprobs, texts
                )
        events_type = self.m.engine_channel.Events
        import msgspec

        self.encode = msgspec.msgpack.encode
        self.decode = msgspec.msgpack.Decoder(events_type).decode
        self.events_type = events_type

    def step(self, runner_out) -> int:
        """One step's output path; returns the number of stream messages made."""
        messages = 0
        if self.one_path:
            outs = self.core._finish_step(None, runner_out)
            if self.stream:  # the scheduler actor sends them; the front door reads them
                outs = self.decode(self.encode(self.events_type(outputs=outs))).outputs
            processed = self.processor.process(outs)
            assert not processed.stopped
            for delta in processed.outputs:
                messages += len(self.responders[delta.request_id].update(delta))
        else:
            outs = self.engine._finish_step(None, runner_out)
            if self.stream:
                deltas = [self.encoder.delta(out) for out in outs]
                events = self.decode(self.encode(self.events_type(deltas=deltas)))
                outs = [self.decoder.apply(d) for d in events.deltas]
            for out in outs:
                messages += len(self.responders[out.request_id].update(out))
        return messages


def load_modules():
    import importlib

    def optional(name):
        try:
            return importlib.import_module(name)
        except ImportError:
            return None

    return SimpleNamespace(
        engine=importlib.import_module("kvloom.cluster.engine"),
        engine_core=optional("kvloom.cluster.engine_core"),
        engine_channel=importlib.import_module("kvloom.cluster.engine_channel"),
        output_processor=importlib.import_module("kvloom.cluster.output_processor"),
        responses=importlib.import_module("kvloom.cluster.frontend.responses"),
        request=importlib.import_module("kvloom.cluster.request"),
        sampling=importlib.import_module("kvloom.contracts.sampling_params"),
        tokenizer=importlib.import_module("kvloom.cluster.tokenizer"),
    )


def run_scenario(m, args, tokenizer, scenario: str, stream: bool) -> dict:
    rng = random.Random(args.seed)
    vocab = tokenizer.vocab_size
    # Ordinary tokens only (the specials decode to nothing and would flatter both designs).
    ordinary = [t for t in range(vocab) if t not in tokenizer.special_ids]
    stop = ["\n\nUser:", "###"] if scenario == "stop+logprobs" else None
    logprobs = 2 if scenario == "stop+logprobs" else None
    params = m.sampling.SamplingParams(
        max_tokens=args.steps + 1, temperature=0.0, ignore_eos=True, stop=stop, logprobs=logprobs
    )
    params = dataclasses.replace(params, eos_token_ids=(0,))
    requests = []
    for i in range(args.requests):
        prompt = [rng.choice(ordinary) for _ in range(args.prompt_len)]
        request = m.request.Request(f"r{i}", prompt, params)
        request.status = m.request.RequestStatus.RUNNING
        request.num_cached_tokens = 0
        requests.append(request)
    scheduler = StandInScheduler(requests, rng, vocab)
    design = Design(m, tokenizer, requests, scheduler, stream)
    cpu_ms, wall_ms = [], []
    for _ in range(args.steps):
        sampled = {r.request_id: rng.choice(ordinary) for r in requests}
        raw = (
            {
                rid: [(-0.5, 1, [(tid, -0.5), (rng.choice(ordinary), -1.5)])]
                for rid, tid in sampled.items()
            }
            if logprobs
            else {}
        )
        runner_out = SimpleNamespace(sampled=sampled, logprobs=raw)
        before = scheduler.seconds
        wall, cpu = time.perf_counter(), time.thread_time()
        design.step(runner_out)
        stand_in = scheduler.seconds - before
        cpu_ms.append((time.thread_time() - cpu - stand_in) * 1e3)
        wall_ms.append((time.perf_counter() - wall - stand_in) * 1e3)
    windows = {}
    for end in args.report_at:
        cpu = cpu_ms[max(0, end - args.window) : end]
        wall = wall_ms[max(0, end - args.window) : end]
        windows[str(end)] = {
            "cpu_median_ms": round(statistics.median(cpu), 3),
            "cpu_mean_ms": round(statistics.fmean(cpu), 3),
            "wall_median_ms": round(statistics.median(wall), 3),
        }
    return {
        "scenario": scenario,
        "channel": stream,
        "cpu_mean_ms_all_steps": round(statistics.fmean(cpu_ms), 3),
        "by_output_length": windows,
    }


def run_detokenizer_only(args, tokenizer, native: bool | None) -> dict:
    """Only `IncrementalDetokenizer.push`, one ordinary token per request per step: the
    part of the output path that `native` (the tokenizers library's DecodeStream, or the
    Python window path; None: the tree's only path) changes, without the rest's noise."""
    from kvloom.cluster.detokenizer import IncrementalDetokenizer

    rng = random.Random(args.seed)
    ordinary = [t for t in range(tokenizer.vocab_size) if t not in tokenizer.special_ids]
    extra = {} if native is None else {"native": native}
    detoks = [
        IncrementalDetokenizer(
            tokenizer, [rng.choice(ordinary) for _ in range(args.prompt_len)], True, **extra
        )
        for _ in range(args.requests)
    ]
    cpu_ms = []
    for _ in range(args.steps):
        tokens = [[rng.choice(ordinary)] for _ in detoks]
        cpu = time.thread_time()
        for detok, ids in zip(detoks, tokens):
            detok.push(ids)
        cpu_ms.append((time.thread_time() - cpu) * 1e3)
    name = {None: "detokenizer", True: "detokenizer (native)", False: "detokenizer (python)"}
    return {
        "scenario": name[native],
        "channel": False,
        "cpu_mean_ms_all_steps": round(statistics.fmean(cpu_ms), 3),
        "cpu_median_ms_all_steps": round(statistics.median(cpu_ms), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", type=Path, default=None, help="a source tree to measure")
    parser.add_argument("--model", default=None, help="tokenizer dir (default: a demo model)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=1024)
    parser.add_argument("--window", type=int, default=64, help="steps averaged per report")
    parser.add_argument("--report-at", type=int, nargs="+", default=[64, 512, 1024])
    parser.add_argument("--channel", action="store_true", help="also through the Ray channel")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--detokenizer-only",
        action="store_true",
        help="time only the incremental detokenizer (both of its paths where the tree has two)",
    )
    args = parser.parse_args()
    if args.tree is not None:
        use_tree(args.tree.resolve())
    m = load_modules()
    import kvloom

    model = args.model
    if model is None:
        from kvloom.cluster.demo_model import write_demo_model

        model = str(write_demo_model(Path(tempfile.mkdtemp(prefix="kvloom-demo-")), arch="llama"))
    tokenizer = m.tokenizer.Tokenizer(model)
    results = []
    if args.detokenizer_only:
        import inspect

        from kvloom.cluster.detokenizer import IncrementalDetokenizer

        two_paths = "native" in inspect.signature(IncrementalDetokenizer).parameters
        for native in [True, False] if two_paths else [None]:
            results.append(run_detokenizer_only(args, tokenizer, native))
            print(json.dumps(results[-1]), flush=True)
    for stream in [] if args.detokenizer_only else [False, True] if args.channel else [False]:
        for scenario in ("plain", "stop+logprobs"):
            result = run_scenario(m, args, tokenizer, scenario, stream)
            results.append(result)
            print(json.dumps(result), flush=True)
    record = {
        "benchmark": "output_cost",
        "tree": str(args.tree) if args.tree else "installed",
        "kvloom_from": str(Path(kvloom.__file__).parent),
        "design": "one output path" if m.engine_core is not None else "engine + front-door diff",
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "steps": args.steps,
        "tokenizer": model,
        "vocab_size": tokenizer.vocab_size,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
        "results": results,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
