"""Plot of the GPU multi-turn replay, kvloom beside vLLM (docs/benchmarks/hybrid_prefix_cache.md).

python benchmarks/plot_hybrid_prefix_cache.py    # needs matplotlib
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DATA = Path("docs/benchmarks/data")


def main() -> None:
    kvloom = json.loads((DATA / "hybrid_prefix_cache_kvloom_h200.json").read_text())["turns"]
    vllm = json.loads((DATA / "hybrid_prefix_cache_vllm_h200.json").read_text())["turns"]
    fig, (hits, times) = plt.subplots(1, 2, figsize=(11, 4))
    series = (
        (kvloom["on"], "o-", "kvloom (16-token blocks, state checkpoints)"),
        (vllm, "s-", "vLLM 0.26 (align mode, 544-token blocks)"),
    )
    for turns, style, label in series:
        hits.plot(
            [t["turn"] for t in turns], [100 * t["hit_rate"] for t in turns], style, label=label
        )
    hits.set(xlabel="turn", ylabel="prefix-cache hit rate (%)", ylim=(0, 100))
    hits.set_title("Hits per turn, Qwen3-Next shape (4 layers), H200")
    series = (
        (kvloom["on"], "o-", "kvloom, caching on"),
        (kvloom["off"], "x--", "kvloom, caching off"),
        (vllm, "s-", "vLLM, caching on"),
    )
    for turns, style, label in series:
        walls = [1e3 * t["turn_wall_s"] for t in turns]
        times.plot([t["turn"] for t in turns], walls, style, label=label)
    times.set(xlabel="turn", ylabel="turn wall time (ms, 2 conversations)", ylim=(0, 200))
    times.set_title("Turn time (first turns include JIT and compile)")
    for ax in (hits, times):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig("docs/benchmarks/hybrid_prefix_cache_h200.png", dpi=110)


if __name__ == "__main__":
    main()
