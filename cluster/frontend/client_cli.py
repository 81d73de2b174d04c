"""Arguments shared by the client commands (`kvloom chat`, `kvloom generate`): where the
server is, how to authenticate, and the sampling options; and how to print a stream."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument(
        "--server",
        default="127.0.0.1:50051",
        help="HOST:PORT of a kvloom server (default %(default)s)",
    )
    group.add_argument("--auth-token-file", help="file holding the server's bearer token")
    group.add_argument(
        "--tls", action="store_true", help="connect with TLS, trusting the system's roots"
    )
    group.add_argument("--tls-ca", help="connect with TLS, trusting this CA certificate (PEM)")
    group.add_argument("--tls-server-name", help="expected server name in its certificate")
    group.add_argument("--timeout", type=float, default=None, help="deadline per request, seconds")


def add_sampling_arguments(parser: argparse.ArgumentParser, max_tokens: int | None) -> None:
    group = parser.add_argument_group("sampling (unset: the server's defaults)")
    group.add_argument("--max-tokens", type=int, default=max_tokens)
    group.add_argument("--temperature", type=float)
    group.add_argument("--top-p", type=float)
    group.add_argument("--top-k", type=int)
    group.add_argument("--min-p", type=float)
    group.add_argument("--seed", type=int)
    group.add_argument("--stop", action="append", help="a stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", default=None)
    group.add_argument("--repetition-penalty", type=float)


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = (
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "ignore_eos",
        "repetition_penalty",
    )
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def make_client(args: argparse.Namespace):
    from kvloom.client import Client
    from kvloom.cluster.frontend.options import read_token_file

    token = read_token_file(args.auth_token_file) if args.auth_token_file else None
    tls: bool | str = args.tls_ca or bool(args.tls)
    return Client(
        args.server, token=token, tls=tls, server_name=args.tls_server_name, timeout=args.timeout
    )


def print_summary(result: Any, out: TextIO | None = None) -> None:
    """One line after a stream: why it ended and what it cost (stderr by default)."""
    out = out or sys.stderr
    usage = result.usage
    parts = [f"finish: {result.finish_reason}"]
    if result.stop_str is not None:
        parts.append(f"stop {result.stop_str!r}")
    if result.stop_token_id is not None:
        parts.append(f"stop token {result.stop_token_id}")
    if usage is not None:
        parts.append(
            f"tokens: {usage.prompt_tokens} prompt ({usage.cached_tokens} cached), "
            f"{usage.completion_tokens} completion"
        )
    print("[" + "; ".join(parts) + "]", file=out, flush=True)


def print_tool_calls(result: Any, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    for call in result.tool_calls:
        try:
            arguments = json.dumps(json.loads(call.arguments), ensure_ascii=False)
        except ValueError:
            arguments = call.arguments
        print(f"[tool call {call.id}] {call.name}({arguments})", file=out, flush=True)


def stream_events(events, out: TextIO | None = None, reasoning_out: TextIO | None = None):
    """Prints text (or content) to `out` (stdout) as it arrives, reasoning to
    `reasoning_out` (stderr); returns the summed Result."""
    out = out or sys.stdout
    reasoning_out = reasoning_out or sys.stderr
    from kvloom.client import ChatDelta, GenerateDelta, collect

    seen = []
    in_reasoning = False
    for event in events:
        seen.append(event)
        if isinstance(event, ChatDelta) and event.reasoning:
            if not in_reasoning:
                print("[reasoning] ", end="", file=reasoning_out)
                in_reasoning = True
            print(event.reasoning, end="", file=reasoning_out, flush=True)
        text = event.text if isinstance(event, GenerateDelta) else None
        if isinstance(event, ChatDelta):
            text = event.content
        if text:
            if in_reasoning:
                print(file=reasoning_out, flush=True)
                in_reasoning = False
            print(text, end="", file=out, flush=True)
    if in_reasoning:
        print(file=reasoning_out, flush=True)
    result = collect(seen)
    if result.text and not result.text.endswith("\n"):
        print(file=out, flush=True)
    return result
