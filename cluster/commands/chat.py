"""`kvloom chat --server HOST:PORT [MESSAGE]`: chat with a model served by kvloom.

With MESSAGE (or a message piped on stdin) it answers once; on a terminal with no
MESSAGE it keeps a conversation going until an empty line or Ctrl-D. Content streams to
stdout, reasoning to stderr; tool calls are printed when the reply ends.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvloom.cluster.frontend.client_cli import (
    add_connection_arguments,
    add_sampling_arguments,
    make_client,
    print_summary,
    print_tool_calls,
    sampling_kwargs,
    stream_events,
)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "chat",
        help="chat with a model on a kvloom server",
        description="Chat with a model on a kvloom server (the server applies the chat template).",
    )
    parser.add_argument("message", nargs="?", help="the user message (default: interactive)")
    parser.add_argument("--system", help="a system message to start the conversation with")
    parser.add_argument("--tools", type=Path, help="JSON file: a list of OpenAI-style tools")
    parser.add_argument(
        "--tool-choice", default=None, help="auto, none, required, or a function name"
    )
    parser.add_argument(
        "--template-kwargs",
        default=None,
        help="chat template variables as JSON, e.g. '{\"enable_thinking\": false}'",
    )
    parser.add_argument(
        "--no-reasoning", action="store_true", help="treat all generated text as content"
    )
    add_connection_arguments(parser)
    add_sampling_arguments(parser, max_tokens=256)
    parser.set_defaults(func=run)


def _tools(path: Path | None) -> list[dict[str, Any]] | None:
    if path is None:
        return None
    try:
        tools = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"--tools: cannot read {path}: {exc}") from None
    if not isinstance(tools, list):
        raise ValueError("--tools: the file must hold a JSON list of tools")
    return tools


def _tool_choice(value: str | None) -> Any:
    if value is None or value in ("auto", "none", "required"):
        return value
    return {"type": "function", "function": {"name": value}}


def _template_kwargs(value: str | None) -> dict[str, Any] | None:
    if value is None:
        return None
    try:
        kwargs = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"--template-kwargs: not valid JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise ValueError("--template-kwargs must be a JSON object")
    return kwargs


def _assistant_turn(result: Any) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": "assistant", "content": result.content}
    if result.tool_calls:
        turn["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in result.tool_calls
        ]
    return turn


def run(args: argparse.Namespace) -> int:
    from kvloom.client import ServerError

    try:
        options = dict(
            tool_choice=_tool_choice(args.tool_choice),
            chat_template_kwargs=_template_kwargs(args.template_kwargs),
            parse_reasoning=False if args.no_reasoning else None,
            **sampling_kwargs(args),
        )
        tools = _tools(args.tools)
        client = make_client(args)
    except ValueError as exc:
        print(f"kvloom chat: error: {exc}", file=sys.stderr)
        return 2
    messages: list[dict[str, Any]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = args.message is None and sys.stdin.isatty()
    first = args.message if args.message is not None else None
    if first is None and not interactive:
        first = sys.stdin.read()
    with client:
        while True:
            text = first if first is not None else _ask()
            first = None
            if not text:
                return 0
            messages.append({"role": "user", "content": text})
            try:
                result = stream_events(client.chat(messages, tools, **options))
            except ServerError as exc:
                print(f"kvloom chat: {exc}", file=sys.stderr)
                return 1
            except KeyboardInterrupt:
                return 130
            print_tool_calls(result)
            print_summary(result)
            messages.append(_assistant_turn(result))
            if not interactive:
                return 0


def _ask() -> str:
    try:
        return input("you> ").strip()
    except EOFError:
        print()
        return ""
