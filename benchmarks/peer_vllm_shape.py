"""vLLM on another of kvloom's bench shapes, with the peer kit's hybrid workloads (issue 23:
Kimi-Linear beside vLLM).

The kit's bench_hybrid.py (../shared/tools/peer-vllm; batch-1 decode and the 1000-request
offline run, random "dummy" weights, bf16) is written for the Qwen3-Next-24l config. This
runs it unchanged on a config kvloom's `kvloom bench` uses (cluster/bench.py SHAPES).
`write-kit` copies the kit's hybrid folder with a bench_hybrid.py that swaps the config
in, so the kit's own script runs it (its staging, smoke test and retries unchanged):

    # here or on the GPU machine, where kvloom imports (about 14 MB):
    python3 benchmarks/peer_vllm_shape.py write-kit qwen3-next-16l .peer-vllm/c3 \\
        .peer-vllm/c3-qwen3-next-16l
    # the kit's hybrid call (after its call-1 staging), carrying .peer-vllm/c2 and the copy:
    bash .peer-vllm/c3-qwen3-next-16l/run_hybrid.sh

`--engine-arg KEY=VALUE` (repeatable) adds keyword arguments to the kit's `vllm.LLM(...)`;
kvloom's side takes the same limits as `kvloom bench` options. Kimi-Linear-16l needs one on
an H100: vLLM's MLA profile run reserves a prefill workspace of max_num_seqs x its (hybrid-
aligned) block size tokens, 29.5 GiB at the default 1024 sequences, which ran out of memory
beside 53.5 GiB of weights (twenty-first session); so
`write-kit kimi-linear-16l .peer-vllm/c3 OUT --engine-arg max_num_seqs=128` and
`kvloom bench ... --shape kimi-linear-16l --max-num-seqs 128`.

Prints the kit's `RESULT` lines prefixed with the shape's name. vLLM reads Kimi-Linear's
config in the checkpoint's own field names, which kvloom's shape uses too. kvloom's side:
`kvloom bench latency|throughput --shape SHAPE`. (`write-config` and `run` are the two
halves of the same, for a shell where both environments are at hand.)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import shutil
import sys
from pathlib import Path

# The launcher write-kit puts in the copied kit as its bench_hybrid.py. It imports only
# this file (copied beside it), never kvloom: the kit's Python has vLLM, not kvloom.
LAUNCHER = """\"\"\"Written by kvloom's benchmarks/peer_vllm_shape.py write-kit: the peer kit's
bench_hybrid.py (kit_bench_hybrid.py here) on shape_config.json.\"\"\"
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import peer_vllm_shape  # noqa: E402

bench = peer_vllm_shape.load_kit_bench(HERE, "kit_bench_hybrid.py")
peer_vllm_shape.use_config(bench, json.loads((HERE / "shape_config.json").read_text()))
bench.main()
"""


ENGINE_ARGS_KEY = "kvloom_engine_args"  # extra vllm.LLM keyword arguments, not model config


def parse_engine_args(pairs: list[str]) -> dict:
    """["max_num_seqs=128", ...] -> {"max_num_seqs": 128, ...}; values read as JSON where
    they parse (numbers, true/false), else kept as strings."""
    parsed = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise SystemExit(f"--engine-arg {pair!r}: expected KEY=VALUE, KEY a Python name")
        try:
            parsed[key] = json.loads(value)
        except json.JSONDecodeError:
            parsed[key] = value
    return parsed


def write_config(shape: str, out: Path, engine_args: dict | None = None) -> dict:
    from kvloom.cluster.bench import shape_config

    config = {"torch_dtype": "bfloat16", **shape_config(shape), "kvloom_shape": shape}
    if engine_args:
        config[ENGINE_ARGS_KEY] = engine_args
    out.write_text(json.dumps(config, indent=1))
    return config


def load_kit_bench(kit_dir: Path, name: str = "bench_hybrid.py"):
    """The peer kit's bench_hybrid.py as a module (it is a script, not a package)."""
    path = Path(kit_dir) / name
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
    engine_args = config.pop(ENGINE_ARGS_KEY, {})
    bench.CONFIG = config
    bench.MODEL_DIR = f"/tmp/{shape}-dummy"
    printed = bench.res
    bench.res = lambda key, value: printed(f"{shape}_{key}", value)
    if engine_args:
        kit_main = bench.main

        def main_with_engine_args():
            bench.res("engine_args", json.dumps(engine_args, sort_keys=True))
            with extra_llm_kwargs(engine_args):
                return kit_main()

        bench.main = main_with_engine_args
    return shape


@contextlib.contextmanager
def extra_llm_kwargs(engine_args: dict):
    """vllm.LLM with `engine_args` added to every construction (the kit imports LLM from
    vllm inside its main, so replacing the module attribute reaches it)."""
    import vllm

    kit_llm = vllm.LLM

    def llm(*args, **kwargs):
        return kit_llm(*args, **{**kwargs, **engine_args})

    vllm.LLM = llm
    try:
        yield
    finally:
        vllm.LLM = kit_llm


def write_kit(shape: str, kit_dir: Path, out: Path, engine_args: dict | None = None) -> None:
    """A copy of the kit's hybrid folder whose bench_hybrid.py runs `shape`."""
    kit_dir = Path(kit_dir)
    if not (kit_dir / "bench_hybrid.py").is_file() or not (kit_dir / "run_hybrid.sh").is_file():
        raise SystemExit(
            f"{kit_dir}: not the kit's hybrid folder (no bench_hybrid.py / run_hybrid.sh)"
        )
    out.mkdir(parents=True, exist_ok=True)
    for path in kit_dir.iterdir():
        if path.is_file() and path.name != "bench_hybrid.py":
            shutil.copy2(path, out / path.name)
    shutil.copy2(kit_dir / "bench_hybrid.py", out / "kit_bench_hybrid.py")
    shutil.copy2(Path(__file__), out / "peer_vllm_shape.py")
    write_config(shape, out / "shape_config.json", engine_args)
    (out / "bench_hybrid.py").write_text(LAUNCHER)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    write = sub.add_parser("write-config", help="kvloom's config.json of a bench shape")
    write.add_argument("shape")
    write.add_argument("out", type=Path)
    run = sub.add_parser("run", help="the kit's hybrid workloads on a written config")
    run.add_argument("kit_dir", type=Path, help="the peer kit's folder with bench_hybrid.py")
    run.add_argument("config", type=Path)
    kit = sub.add_parser("write-kit", help="a copy of the kit's hybrid folder for a shape")
    kit.add_argument("shape")
    kit.add_argument("kit_dir", type=Path, help="the peer kit's folder with bench_hybrid.py")
    kit.add_argument("out", type=Path)
    for command in (write, kit):
        command.add_argument(
            "--engine-arg",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a keyword argument added to the kit's vllm.LLM(...) (repeatable)",
        )
    args = parser.parse_args(argv)
    if args.command == "write-config":
        write_config(args.shape, args.out, parse_engine_args(args.engine_arg))
        return
    if args.command == "write-kit":
        write_kit(args.shape, args.kit_dir, args.out, parse_engine_args(args.engine_arg))
        return
    bench = load_kit_bench(args.kit_dir)
    use_config(bench, json.loads(args.config.read_text()))
    bench.main()


if __name__ == "__main__":
    sys.exit(main())
