"""`kvloom quickstart`: the README's main job on the embedded default.

Writes a tiny demo model (if not there yet), starts an embedded local Ray with the
scheduler actor and a worker actor, serves them over gRPC on 127.0.0.1 (a free port),
streams a chat through the real gRPC client, and shuts down. `--no-ray` keeps the engine
in this process.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULT_DIR = Path.home() / ".cache" / "kvloom" / "demo-model"
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Once upon a time, what did the quick brown fox do?"},
]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "quickstart",
        help="run kvloom end to end on a demo model: server, client, chat",
        description=(
            "Write a tiny random-weight demo model (if missing), serve it over gRPC on "
            "127.0.0.1, stream a chat to it with kvloom.Client, and shut down. The model's "
            "weights are random, so its reply is gibberish; everything around it is real."
        ),
    )
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--no-ray", action="store_true", help="run the engine in this process")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvloom.client import Client
    from kvloom.cluster.demo_model import RANDOM_WEIGHTS_NOTE, is_demo_model, write_demo_model
    from kvloom.cluster.frontend import BackgroundServer, ServerOptions, engine_factory
    from kvloom.cluster.frontend.client_cli import print_summary, stream_events

    started = time.monotonic()
    model_dir = args.model_dir
    if not (model_dir / "config.json").is_file():
        print(f"writing a demo model to {model_dir}", flush=True)
        write_demo_model(model_dir)
    options = ServerOptions(
        model=str(model_dir),
        host="127.0.0.1",
        port=0,  # a free port
        tool_call_parser="hermes",  # the demo model's chat template is ChatML with Hermes tools
        reasoning_parser="think",
    )
    executor = "inprocess" if args.no_ray else "ray"
    factory = engine_factory(model=str(model_dir), progress=False, executor=executor)
    with BackgroundServer(factory, options) as server:
        where = "in this process" if args.no_ray else "scheduler and worker as local Ray actors"
        print(
            f"server ready at {server.address} ({time.monotonic() - started:.1f} s, engine "
            f"{where}): kvloom.v1.Generation, health, reflection",
            flush=True,
        )
        with Client(server.address, timeout=60) as client:
            print(f"health: {client.health()}", flush=True)
            for message in MESSAGES:
                print(f"{message['role']}: {message['content']}", flush=True)
            if is_demo_model(model_dir):
                print(f"(note: {RANDOM_WEIGHTS_NOTE})", flush=True)
            print("assistant: ", end="", flush=True)
            events = client.chat(MESSAGES, max_tokens=args.max_tokens, temperature=0.8, seed=0)
            result = stream_events(events, out=sys.stdout, reasoning_out=sys.stdout)
            print_summary(result, out=sys.stdout)
        stats = server.stats()
        print(
            f"shutting down: {stats['num_finished']} requests done, "
            f"{stats['num_free_blocks']}/{stats['num_blocks']} KV blocks free",
            flush=True,
        )
    print(f"done in {time.monotonic() - started:.1f} s", flush=True)
    return 0
