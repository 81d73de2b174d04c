"""vLLM on another of kvloom's bench shapes, with the peer kit's hybrid workloads (issue 23:
Kimi-Linear beside vLLM).

The kit's bench_hybrid.py (../shared/tools/peer-vllm; batch-1 decode and the 1000-request
offline run, random "dummy" weights, bf16) is written for the Qwen3-Next-24l config. This
runs it unchanged on a config kvloom's `kvloom bench` uses (cluster/bench.py SHAPES), in
two steps because kvloom and the kit's vLLM live on different PYTHONPATHs on the GPU
machine:

    # kvloom's environment: the shape's config.json as kvloom benches it
    python3 benchmarks/peer_vllm_shape.py write-config kimi-linear-16l /tmp/kimi.json
    # the kit's environment (after its call-1 staging, as run_hybrid.sh sets up):
    BENCH="benchmarks/peer_vllm_shape.py run .peer-vllm/c3 /tmp/kimi.json" \\
        bash .peer-vllm/c3/run_hybrid.sh

Prints the kit's `RESULT` lines prefixed with the shape's name. vLLM reads Kimi-Linear's
config in the checkpoint's own field names, which kvloom's shape uses too. kvloom's side:
`kvloom bench latency|throughput --shape kimi-linear-16l`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path


def write_config(shape: str, out: Path) -> dict:
    from kvloom.cluster.bench import shape_config

    config = {"torch_dtype": "bfloat16", **shape_config(shape), "kvloom_shape": shape}
    out.write_text(json.dumps(config, indent=1))
    return config


def load_kit_bench(kit_dir: Path):
    """The peer kit's bench_hybrid.py as a module (it is a script, not a package)."""
    path = Path(kit_dir) / "bench_hybrid.py"
    if not path.is_file():
        raise SystemExit(
            f"{path}: not found (build the kit with ../shared/tools/peer-vllm/build.sh and "
            "pass the folder holding its bench_hybrid.py, e.g. .peer-vllm/c3)"
        )
    spec = importlib.util.spec_from_file_location("peer_vllm_bench_hybrid", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def use_config(bench, config: dict) -> str:
    """Points the kit at `config`, in a model folder of its own; returns the shape's name."""
    config = dict(config)
    shape = config.pop("kvloom_shape", "shape")
    bench.CONFIG = config
    bench.MODEL_DIR = f"/tmp/{shape}-dummy"
    printed = bench.res
    bench.res = lambda key, value: printed(f"{shape}_{key}", value)
    return shape


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    write = sub.add_parser("write-config", help="kvloom's config.json of a bench shape")
    write.add_argument("shape")
    write.add_argument("out", type=Path)
    run = sub.add_parser("run", help="the kit's hybrid workloads on a written config")
    run.add_argument("kit_dir", type=Path, help="the peer kit's folder with bench_hybrid.py")
    run.add_argument("config", type=Path)
    args = parser.parse_args(argv)
    if args.command == "write-config":
        write_config(args.shape, args.out)
        return
    bench = load_kit_bench(args.kit_dir)
    use_config(bench, json.loads(args.config.read_text()))
    bench.main()


if __name__ == "__main__":
    sys.exit(main())
