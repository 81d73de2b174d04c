"""`kvloom generate --server HOST:PORT PROMPT`: stream a raw completion from a server."""

from __future__ import annotations

import argparse
import sys

from kvloom.cluster.frontend.client_cli import (
    add_connection_arguments,
    add_sampling_arguments,
    make_client,
    print_summary,
    sampling_kwargs,
    stream_events,
)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="stream a completion from a kvloom server",
        description="Stream a raw completion (no chat template) from a kvloom server.",
    )
    parser.add_argument("prompt", nargs="?", help="prompt text (default: read stdin)")
    parser.add_argument(
        "--token-ids", help="the prompt as comma-separated token ids instead of text"
    )
    parser.add_argument("--show-token-ids", action="store_true", help="print the generated ids")
    add_connection_arguments(parser)
    add_sampling_arguments(parser, max_tokens=64)
    parser.set_defaults(func=run)


def _prompt(args: argparse.Namespace) -> str | list[int]:
    if args.token_ids is not None:
        if args.prompt is not None:
            raise ValueError("give a text prompt or --token-ids, not both")
        try:
            return [int(t) for t in args.token_ids.split(",") if t.strip()]
        except ValueError:
            raise ValueError(
                f"--token-ids must be comma-separated integers, got {args.token_ids!r}"
            ) from None
    if args.prompt is not None:
        return args.prompt
    if sys.stdin.isatty():
        raise ValueError("give a prompt (or pipe one on stdin)")
    return sys.stdin.read()


def run(args: argparse.Namespace) -> int:
    from kvloom.client import ServerError

    try:
        prompt = _prompt(args)
        client = make_client(args)
    except ValueError as exc:
        print(f"kvloom generate: error: {exc}", file=sys.stderr)
        return 2
    with client:
        try:
            result = stream_events(client.generate(prompt, **sampling_kwargs(args)))
        except ServerError as exc:
            print(f"kvloom generate: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    if args.show_token_ids:
        print("token ids:", ",".join(map(str, result.token_ids)))
    print_summary(result)
    return 0
