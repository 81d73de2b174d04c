"""A burst of concurrent gRPC Generate streams against a real `kvloom serve` process.

Starts `kvloom serve` (a subprocess, `--executor ray` or `inprocess`, on 127.0.0.1 and a
free port), waits for readiness SERVING, then opens N greedy streams at once and records,
per stream, the time to its first token (TTFT, from the burst's start), its mean time per
output token after the first (TPOT), and how many token deltas it arrived in. Writes one
JSON record per (executor, N).

    python benchmarks/serve_burst.py --model /tmp/demo --streams 100 500 1000 \\
        --executors ray inprocess --out docs/benchmarks/data/serve_burst_cpu.json

`--kvloom` names the `kvloom` executable to serve with (e.g. an older checkout's venv, to
measure before and after); the client is this checkout's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvloom.client import AsyncClient, Client, GenerateDelta, ServerError

READINESS = "kvloom.v1.Generation"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt_ids(i: int) -> list[int]:
    return [5 + (i * 37 + j * 11) % 500 for j in range(8 + i % 9)]


def percentiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": values[-1]}


def start_server(args, executor: str, port: int) -> subprocess.Popen:
    cmd = [
        args.kvloom,
        "serve",
        "--model",
        args.model,
        "--executor",
        executor,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-queue",
        "4096",
        "--num-kv-blocks",
        str(args.num_kv_blocks),
        "--log-level",
        "WARNING",
    ]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    with Client(f"127.0.0.1:{port}", timeout=5) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"kvloom serve exited with {proc.returncode}")
            try:
                if client.health(READINESS) == "SERVING":
                    return proc
            except ServerError:
                pass
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("kvloom serve was not ready within 300 s")


def stop_server(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


async def burst(address: str, n: int, max_tokens: int) -> dict:
    async with AsyncClient(address, timeout=600) as client:
        start = time.monotonic()

        async def one(i: int):
            times, deltas, tokens = [], 0, 0
            async for event in client.generate(
                prompt_ids(i), max_tokens=max_tokens, temperature=0.0, ignore_eos=True
            ):
                if isinstance(event, GenerateDelta):
                    times.append(time.monotonic() - start)
                    deltas += 1
                    tokens += len(event.token_ids)
            return times, deltas, tokens

        results = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.monotonic() - start
    ttft = [r[0][0] for r in results]
    tpot = [(r[0][-1] - r[0][0]) / max(r[2] - 1, 1) for r in results]
    tokens = sum(r[2] for r in results)
    return {
        "streams": n,
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / wall,
        "ttft_s": percentiles(ttft),
        "tpot_s": percentiles(tpot),
        "deltas_per_stream": percentiles([float(r[1]) for r in results]),
        "ttft_p50_over_wall": statistics.median(ttft) / wall,
        "streams_with_a_token_by_90pct_of_wall": sum(t <= 0.9 * wall for t in ttft),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--streams", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument("--executors", nargs="+", default=["ray", "inprocess"])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--num-kv-blocks", type=int, default=8192)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kvloom", default=str(Path(sys.executable).parent / "kvloom"))
    parser.add_argument("--label", default="", help="a name for this build (e.g. before)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    records = []
    for executor in args.executors:
        port = free_port()
        proc = start_server(args, executor, port)
        try:
            for n in args.streams:
                record = asyncio.run(burst(f"127.0.0.1:{port}", n, args.max_tokens))
                record.update(executor=executor, label=args.label, max_tokens=args.max_tokens)
                records.append(record)
                print(
                    f"{args.label or 'this build'} {executor:9s} {n:5d} streams: "
                    f"wall {record['wall_s']:6.2f} s, {record['output_tok_per_s']:7.0f} tok/s, "
                    f"TTFT p50 {record['ttft_s']['p50']:.2f} s p99 {record['ttft_s']['p99']:.2f} s, "
                    f"TPOT p50 {record['tpot_s']['p50'] * 1000:.0f} ms, "
                    f"deltas p50 {record['deltas_per_stream']['p50']:.0f}",
                    flush=True,
                )
        finally:
            stop_server(proc)
    out = {
        "machine": f"{platform.node()} {os.cpu_count()} cores",
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
        "records": records,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else None
    if previous and previous.get("records"):
        out["records"] = previous["records"] + records
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
