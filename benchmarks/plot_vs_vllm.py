"""kvloom's speed against vLLM 0.26's on an H100, the latest pair of each workload, read
from the recorded runs in docs/benchmarks/data (kvloom's `kvloom bench` JSON, the peer
kit's log of vLLM's RESULT lines) rather than typed in. Writes
docs/benchmarks/data/vs_vllm_latest_h100.json, and docs/benchmarks/vs_vllm_latest_h100.png
when matplotlib is installed (the engine does not need it):

    python benchmarks/plot_vs_vllm.py

A pair from one lease is drawn solid; kvloom's later figure against an earlier lease's
vLLM is drawn hatched and said so (vLLM's own figures moved by up to 1.5x between leases
on the same machine kind: gpu_fast_path.md, twenty-eighth session).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
DATA = DOCS / "data"


@dataclass(frozen=True)
class Pair:
    workload: str
    kvloom_file: str  # a `kvloom bench` JSON
    vllm_log: str  # the peer kit's log
    vllm_key: str  # the RESULT key; a time (ms/token or seconds), as kvloom's figure
    kvloom_lease: str
    vllm_lease: str
    goal: float | None  # issue 23's goal for kvloom's speed / vLLM's, where it sets one


PAIRS = [
    Pair("Qwen3-8B batch-1", "kvloom_qwen3-8b_latency_h100_2026-12-06s21.json",
         "peer_vllm_qwen3-8b_h100_2026-12-06s21.log", "a_ms_per_tok_decode",
         "twenty-first", "twenty-first", None),
    Pair("Qwen3-8B batch-1", "latency_qwen3-8b_3_h100_2026-12-07s27.json",  # the median of 3
         "peer_vllm_qwen3-8b_h100_2026-12-06s21.log", "a_ms_per_tok_decode",
         "twenty-seventh", "twenty-first", None),
    Pair("Qwen3-8B offline", "kvloom_qwen3-8b_throughput_1_h100_2026-12-06s21.json",
         "peer_vllm_qwen3-8b_h100_2026-12-06s21.log", "b_wall_s",
         "twenty-first", "twenty-first", 1.10),
    Pair("Qwen3-Next-16l batch-1", "latency_qwen3-next-16l_f32_run2_h100_2026-12-07s28.json",
         "peer_vllm_qwen3-next-16l_h100_2026-12-07s28.log", "qwen3-next-16l_a_ms_per_tok_decode",
         "twenty-eighth", "twenty-eighth", 1.5),
    Pair("Qwen3-Next-16l offline (bf16 state)", "throughput_qwen3-next-16l_bf16_h100_2026-12-07s28.json",
         "peer_vllm_qwen3-next-16l_h100_2026-12-07s28.log", "qwen3-next-16l_b_wall_s",
         "twenty-eighth", "twenty-eighth", 1.10),
    Pair("Kimi-Linear-16l batch-1", "kvloom_kimi-linear-16l_latency_mns128_h100_2026-12-06s22.json",
         "peer_vllm_kimi-linear-16l_mns128_h100_2026-12-06s22.log", "kimi-linear-16l_a_ms_per_tok_decode",
         "twenty-second", "twenty-second", None),
    Pair("Kimi-Linear-16l batch-1", "latency_kimi-linear-16l_h100_2026-12-07s28.json",
         "peer_vllm_kimi-linear-16l_mns128_h100_2026-12-06s22.log", "kimi-linear-16l_a_ms_per_tok_decode",
         "twenty-eighth", "twenty-second", None),
    Pair("Kimi-Linear-16l offline", "kvloom_kimi-linear-16l_throughput_mns128_h100_2026-12-06s22.json",
         "peer_vllm_kimi-linear-16l_mns128_h100_2026-12-06s22.log", "kimi-linear-16l_b_wall_s",
         "twenty-second", "twenty-second", None),
    Pair("Kimi-Linear-16l offline", "throughput_kimi-linear-16l_mns128_auto_convparallel_h100_2026-12-07s30.json",
         "peer_vllm_kimi-linear-16l_mns128_h100_2026-12-06s22.log", "kimi-linear-16l_b_wall_s",
         "thirtieth", "twenty-second", None),
]  # fmt: skip


def kvloom_figure(run: dict) -> tuple[float, str]:
    """(time, unit) of a `kvloom bench` JSON: latency runs give ms/token, offline seconds."""
    if "ms_per_token" in run:
        return float(run["ms_per_token"]), "ms/token"
    return float(run["seconds"]), "s"


def vllm_result(log_text: str, key: str) -> float:
    """The value of `RESULT <key> <value>` in the peer kit's log (a key appears once per run;
    a log repeats its lines once in its summary: every occurrence must agree)."""
    values = {
        line.split()[2]
        for line in log_text.splitlines()
        if line.startswith("RESULT ") and line.split()[1:2] == [key]
    }
    if len(values) != 1:
        raise ValueError(f"RESULT {key}: expected one value in the vLLM log, got {sorted(values)}")
    return float(values.pop())


def summary(data: Path = DATA) -> list[dict]:
    rows = []
    for pair in PAIRS:
        run = json.loads((data / pair.kvloom_file).read_text())
        kvloom, unit = kvloom_figure(run)
        vllm = vllm_result((data / pair.vllm_log).read_text(), pair.vllm_key)
        rows.append(
            dict(
                workload=pair.workload,
                unit=unit,
                kvloom=kvloom,
                vllm=vllm,
                speed_vs_vllm=round(vllm / kvloom, 3),  # times: vLLM's over kvloom's
                goal=pair.goal,
                same_lease=pair.kvloom_lease == pair.vllm_lease,
                kvloom_lease=pair.kvloom_lease,
                vllm_lease=pair.vllm_lease,
                device=run.get("device"),
                kvloom_file=pair.kvloom_file,
                vllm_log=pair.vllm_log,
            )
        )
    return rows


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    labels = [
        f"{r['workload']}\n({r['kvloom_lease']}"
        + ("" if r["same_lease"] else f"; vLLM {r['vllm_lease']}")
        + ")"
        for r in rows
    ]
    ys = range(len(rows))
    for y, r in zip(ys, rows):
        ax.barh(y, r["speed_vs_vllm"], color="#2a7" if r["speed_vs_vllm"] >= 1 else "#c73",
                hatch=None if r["same_lease"] else "//", edgecolor="#333")  # fmt: skip
        ax.text(r["speed_vs_vllm"], y, f" {r['speed_vs_vllm']:.2f}x", va="center")
        if r["goal"]:
            ax.plot([r["goal"]] * 2, [y - 0.4, y + 0.4], color="#000", linestyle="--", lw=1)
    ax.axvline(1.0, color="#555", linewidth=1)
    ax.set_yticks(list(ys), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("kvloom's speed / vLLM 0.26's (higher is better; dashes: issue 23's goal)")
    title = "kvloom against vLLM on one H100: same-lease pairs solid, later kvloom runs hatched"
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    rows = summary()
    (DATA / "vs_vllm_latest_h100.json").write_text(json.dumps(rows, indent=1) + "\n")
    for r in rows:
        print(f"{r['workload']:38s} {r['kvloom']:>8} {r['vllm']:>8} {r['unit']:9s} "
              f"{r['speed_vs_vllm']:.3f}x{'' if r['same_lease'] else ' (vLLM of another lease)'}")  # fmt: skip
    try:
        plot(rows, DOCS / "vs_vllm_latest_h100.png")
    except ImportError:
        print("matplotlib is not installed: the JSON only")


if __name__ == "__main__":
    main()
