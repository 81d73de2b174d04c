"""Regenerates the committed Python stubs from protos/kvloom/v1/*.proto.

    python protos/generate.py              # rewrite the committed stubs in place
    python protos/generate.py --out DIR    # write them under DIR/kvloom/v1/ (freshness test)

protoc names modules after the proto path, so the stubs it writes import `kvloom.v1`, which
would be the public `kvloom` package. The folder protos/ is installed as `kvloom.protos`, so
after running protoc this script rewrites the Python module paths to
`kvloom.protos.kvloom.v1` (the proto package and file names, which reflection and the wire
format use, stay `kvloom.v1` and `kvloom/v1/...`).

The generated code pins its generator: `_pb2.py` needs a protobuf runtime at least as new as
the protoc inside grpcio-tools (7.35 for grpcio-tools 1.85), and the freshness test expects the
same grpcio-tools version that wrote the committed stubs.

grpcio-tools also writes a guard that refuses to import under any grpcio older than the
generator's own version. The stubs use nothing newer than grpcio 1.63 (`_registered_method`),
and the project requires grpcio >= MIN_GRPCIO (the GPU image has 1.84 while this generator may
be newer), so the guard is lowered to MIN_GRPCIO.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILES = ("kvloom/v1/generation.proto",)
PYTHON_PACKAGE = "kvloom.protos"  # where PROTO_ROOT is importable from
MIN_GRPCIO = "1.66.0"  # keep in step with pyproject.toml's grpcio requirement


def _generated_files(out_dir: Path) -> list[Path]:
    files = []
    for proto in PROTO_FILES:
        stem = out_dir / proto.removesuffix(".proto")
        files += [Path(f"{stem}_pb2.py"), Path(f"{stem}_pb2.pyi"), Path(f"{stem}_pb2_grpc.py")]
    return files


def _fix_module_paths(text: str) -> str:
    """Point protoc's module paths at where the stubs really live."""
    for proto in PROTO_FILES:
        proto_dir = proto.rsplit("/", 1)[0].replace("/", ".")  # kvloom.v1
        text = re.sub(
            rf"^from {re.escape(proto_dir)} import ",
            f"from {PYTHON_PACKAGE}.{proto_dir} import ",
            text,
            flags=re.MULTILINE,
        )
        # The module name given to message classes (their __module__, which pickle uses).
        text = re.sub(
            rf"'{re.escape(proto_dir)}\.(\w+_pb2)'",
            rf"'{PYTHON_PACKAGE}.{proto_dir}.\1'",
            text,
        )
    return text


def _lower_grpc_guard(text: str) -> str:
    return re.sub(
        r"^GRPC_GENERATED_VERSION = '[^']*'$",
        f"GRPC_GENERATED_VERSION = '{MIN_GRPCIO}'",
        text,
        flags=re.MULTILINE,
    )


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc for every proto into out_dir and post-processes; returns the files written."""
    out_dir = Path(out_dir).resolve()  # protoc runs inside PROTO_ROOT
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTO_FILES,
    ]
    result = subprocess.run(cmd, cwd=PROTO_ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"protoc failed ({result.returncode}):\n{result.stderr}")
    files = _generated_files(out_dir)
    for path in files:
        text = _fix_module_paths(path.read_text(encoding="utf-8"))
        if path.name.endswith("_pb2_grpc.py"):
            text = _lower_grpc_guard(text)
        path.write_text(text, encoding="utf-8")
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT, help="output root")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
