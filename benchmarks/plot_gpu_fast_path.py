"""Draws docs/benchmarks/gpu_fast_path.png from docs/benchmarks/data/gpu_fast_path_h200.json
and gpu_fast_path_hybrid.png from gpu_fast_path_h200_lease2.json (needs matplotlib, which
the engine itself does not):

    python benchmarks/plot_gpu_fast_path.py
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


def main() -> None:
    data = json.loads((ROOT / "data" / "gpu_fast_path_h200.json").read_text())
    decode, tput = data["batch1_decode"], data["offline_throughput"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["HBM floor", "kvloom", "vLLM 0.26", "HF static"]
    values = [
        decode["floor_ms_per_token_kvloom_bandwidth"],
        decode["kvloom_ms_per_token"],
        decode["vllm_ms_per_token_decode"],
        decode["hf_static_compiled_ms_per_token"],
    ]
    left.bar(names, values, color=["#999", "#2a7", "#37c", "#c73"])
    left.set_ylabel("ms per token (lower is better)")
    left.set_title("Qwen3-8B shape, bf16, batch-1 decode")
    for i, v in enumerate(values):
        left.text(i, v, f"{v:.2f}", ha="center", va="bottom")
    names = ["kvloom", "vLLM 0.26"]
    values = [tput["kvloom_output_tok_s"], tput["vllm_output_tok_s"]]
    right.bar(names, values, color=["#2a7", "#37c"])
    right.set_ylabel("output tokens/s (higher is better)")
    right.set_title("1000 requests offline")
    for i, v in enumerate(values):
        right.text(i, v, f"{v:,.0f}", ha="center", va="bottom")
    fig.suptitle("One H200, same lease (2026-11-29)")
    fig.tight_layout()
    fig.savefig(ROOT / "gpu_fast_path.png", dpi=110)
    plot_hybrid(json.loads((ROOT / "data" / "gpu_fast_path_h200_lease2.json").read_text()))


def plot_hybrid(data: dict) -> None:
    hybrid = data["hybrid_qwen3_next_24l"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    bars = [
        ("HBM floor", hybrid["floor_ms_per_token"]),
        ("kvloom", hybrid["kvloom_batch1_ms_per_token"]),
        ("vLLM 0.26", hybrid["vllm_batch1_ms_per_token_decode"]),
    ]
    left.bar([n for n, _ in bars], [v for _, v in bars], color=["#999", "#2a7", "#37c"])
    left.set_ylabel("ms per token (lower is better)")
    left.set_title("Qwen3-Next shape (24 layers), batch-1 decode")
    for i, (_, v) in enumerate(bars):
        left.text(i, v, f"{v:.2f}", ha="center", va="bottom")
    values = [hybrid["kvloom_output_tok_s"], hybrid["vllm_output_tok_s"]]
    right.bar(["kvloom", "vLLM 0.26"], values, color=["#2a7", "#37c"])
    right.set_ylabel("output tokens/s (higher is better)")
    right.set_title("1000 requests offline")
    for i, v in enumerate(values):
        right.text(i, v, f"{v:,.0f}", ha="center", va="bottom")
    fig.suptitle("One H200, same lease (2026-11-30)")
    fig.tight_layout()
    fig.savefig(ROOT / "gpu_fast_path_hybrid.png", dpi=110)


if __name__ == "__main__":
    main()
