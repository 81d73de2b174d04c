"""vLLM's FP8 figures beside kvloom's (issue 22), on the GPU machine.

The peer kit's workloads (../shared/tools/peer-vllm/bench.py: batch-1 decode and the
1000-request offline run) on its Qwen3-8B-shaped config with random ("dummy") weights,
but with the config's `quantization_config` saying what a published FP8 checkpoint says:
e4m3 weights in 128 x 128 blocks, dynamic per-token-group activation scales. vLLM then
builds its block-FP8 linear layers, as it would for Qwen3-8B-FP8. Needs only vLLM (the
kit's install: run after `run2.sh` in the same call); the kit's bench.py is imported from
its folder and run unchanged, on this config.

    python3 benchmarks/peer_vllm_fp8.py .peer-vllm/c2 [--scheme fp8-block|fp8-tensor]

Prints the kit's `RESULT` lines prefixed `fp8_`. kvloom's side of the comparison (its
`fp8` is the 128 x 128 block format, the default scheme here):
`kvloom bench latency|throughput --shape qwen3-8b --quantization fp8`.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

# What the checkpoints carry (Qwen/Qwen3-8B-FP8's config, for example).
SCHEMES = {
    "fp8-block": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
    # One scale per weight tensor: the older FP8 checkpoints' layout.
    "fp8-tensor": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"},
}


def load_kit_bench(kit_dir: Path):
    """The peer kit's bench.py as a module (it is a script, not a package)."""
    path = Path(kit_dir) / "bench.py"
    if not path.is_file():
        raise SystemExit(
            f"{path}: not found (build the kit with ../shared/tools/peer-vllm/build.sh and "
            "pass the folder holding its bench.py, e.g. .peer-vllm/c2)"
        )
    spec = importlib.util.spec_from_file_location("peer_vllm_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def use_fp8_config(bench, scheme: str) -> None:
    """Points the kit at an FP8 copy of its config, in a folder of its own."""
    bench.CONFIG = {**bench.CONFIG, "quantization_config": dict(SCHEMES[scheme])}
    bench.MODEL_DIR = f"{bench.MODEL_DIR}-{scheme}"
    printed = bench.res
    bench.res = lambda key, value: printed(f"fp8_{key}", value)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kit_dir", type=Path, help="the peer kit's folder with bench.py")
    parser.add_argument("--scheme", choices=sorted(SCHEMES), default="fp8-block")
    args = parser.parse_args(argv)
    bench = load_kit_bench(args.kit_dir)
    use_fp8_config(bench, args.scheme)
    bench.res("scheme", args.scheme)
    bench.mode_vllm()


if __name__ == "__main__":
    sys.exit(main())
