"""Draws docs/benchmarks/gpu_fast_path.png from docs/benchmarks/data/gpu_fast_path_h200.json,
gpu_fast_path_hybrid.png from gpu_fast_path_h200_lease2.json and gpu_fast_path_lease3.png
from gpu_fast_path_h200_lease3.json (needs matplotlib, which the engine itself does not):

    python benchmarks/plot_gpu_fast_path.py
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


COLORS = {"HBM floor": "#999", "kvloom": "#2a7", "vLLM 0.26": "#37c", "HF static": "#c73"}


def bars(ax, values: dict, ylabel: str, title: str, fmt: str) -> None:
    ax.bar(list(values), list(values.values()), color=[COLORS[n] for n in values])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    for i, v in enumerate(values.values()):
        ax.text(i, v, format(v, fmt), ha="center", va="bottom")


def figure(out: str, title: str, decode: dict, decode_title: str, offline: dict) -> None:
    """Batch-1 ms/token on the left, offline output tokens/s on the right."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    bars(left, decode, "ms per token (lower is better)", decode_title, ".2f")
    bars(right, offline, "output tokens/s (higher is better)", "1000 requests offline", ",.0f")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(ROOT / out, dpi=110)


def main() -> None:
    data = json.loads((ROOT / "data" / "gpu_fast_path_h200.json").read_text())
    decode, tput = data["batch1_decode"], data["offline_throughput"]
    figure(
        "gpu_fast_path.png",
        "One H200, same lease (2026-11-29)",
        {
            "HBM floor": decode["floor_ms_per_token_kvloom_bandwidth"],
            "kvloom": decode["kvloom_ms_per_token"],
            "vLLM 0.26": decode["vllm_ms_per_token_decode"],
            "HF static": decode["hf_static_compiled_ms_per_token"],
        },
        "Qwen3-8B shape, bf16, batch-1 decode",
        {"kvloom": tput["kvloom_output_tok_s"], "vLLM 0.26": tput["vllm_output_tok_s"]},
    )
    lease2 = json.loads((ROOT / "data" / "gpu_fast_path_h200_lease2.json").read_text())
    hybrid = lease2["hybrid_qwen3_next_24l"]
    figure(
        "gpu_fast_path_hybrid.png",
        "One H200, same lease (2026-11-30)",
        {
            "HBM floor": hybrid["floor_ms_per_token"],
            "kvloom": hybrid["kvloom_batch1_ms_per_token"],
            "vLLM 0.26": hybrid["vllm_batch1_ms_per_token_decode"],
        },
        "Qwen3-Next shape (24 layers), batch-1 decode",
        {"kvloom": hybrid["kvloom_output_tok_s"], "vLLM 0.26": hybrid["vllm_output_tok_s"]},
    )
    lease3 = json.loads((ROOT / "data" / "gpu_fast_path_h200_lease3.json").read_text())
    dense, vllm = lease3["dense_qwen3_8b"], lease3["dense_qwen3_8b"]["vllm_same_lease"]
    figure(
        "gpu_fast_path_lease3.png",
        "One H200, same lease (2026-11-30, third lease)",
        {
            "HBM floor": dense["floor_ms_per_token"],
            "kvloom": dense["kvloom_batch1_ms_per_token"],
            "vLLM 0.26": vllm["batch1_ms_per_token_decode"],
        },
        "Qwen3-8B shape, bf16, batch-1 decode",
        {"kvloom": dense["kvloom_output_tok_s"], "vLLM 0.26": vllm["output_tok_s"]},
    )


if __name__ == "__main__":
    main()
