"""`kvloom` command line: each subcommand lives in `kvloom.cluster.commands.<name>`.

A command module exposes `register(subparsers)`, which adds its parser and sets
`func` (called with the parsed args, returning an exit code). Modules are discovered,
so adding a command never edits this file.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

from kvloom.cluster import commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvloom", description="kvloom LLM serving engine")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # gRPC's C core logs fork notices at INFO when Ray forks beside a live channel.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
