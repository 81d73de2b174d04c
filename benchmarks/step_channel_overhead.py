"""Per-step overhead: the zmq step channel vs. a Ray actor call round trip.

One step = the scheduler sends a SchedulerOutput-sized message (default: 64 requests, 60 in
decode and 4 in a prefill chunk) to 2 worker actors, and gets a ModelRunnerOutput-sized
answer from one of them (rank 0, the sampling rank). Compared:

- channel/tcp, channel/ipc: `StepPublisher.publish(msg)` -> both actors `recv()` (msgpack
  decode) -> rank 0 `ResultSender.send(out)` -> driver `ResultChannel.recv()`.
- ray/object: `ray.get([a.step.remote(msg) for a in actors])` (Ray pickles the Struct).
- ray/bytes: the same with the message pre-encoded as msgpack bytes.

The workers do no model work, so this is the pure transport cost per step.

    python benchmarks/step_channel_overhead.py --out /tmp/step_channel.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import msgspec
import ray
import zmq

from kvloom.cluster.ray_local import connect_ray, shutdown_ray
from kvloom.contracts.step_channel import (
    ChannelClosed,
    ResultChannel,
    ResultSender,
    StepPublisher,
    StepSubscriber,
)


class SamplingParamsMsg(msgspec.Struct, array_like=True):
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop_token_ids: list[int]


class NewRequestMsg(msgspec.Struct, array_like=True):
    req_id: str
    prompt_token_ids: list[int]
    block_ids: list[list[int]]  # per KV cache group
    num_computed_tokens: int
    sampling: SamplingParamsMsg


class CachedRequestsMsg(msgspec.Struct, array_like=True):
    req_ids: list[str]
    new_token_ids: list[list[int]]
    new_block_ids: list[list[list[int]] | None]
    num_computed_tokens: list[int]


class SchedulerOutputMsg(msgspec.Struct, array_like=True):
    step_id: int
    new_requests: list[NewRequestMsg]
    cached: CachedRequestsMsg
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str]


class ModelRunnerOutputMsg(msgspec.Struct, array_like=True):
    step_id: int
    req_ids: list[str]
    sampled_token_ids: list[list[int]]


def make_scheduler_output(step_id: int, num_requests: int, prefill_tokens: int = 128):
    """A realistic decode-heavy step: most requests decode one token, a few prefill a chunk
    and bring their prompt, block tables (2 KV groups) and sampling parameters."""
    num_new = max(1, num_requests // 16)
    new = [
        NewRequestMsg(
            req_id=f"req-{step_id}-{i}",
            prompt_token_ids=list(range(1000 + i, 1000 + i + prefill_tokens)),
            block_ids=[list(range(i * 8, i * 8 + 8)), list(range(5000 + i * 8, 5000 + i * 8 + 8))],
            num_computed_tokens=0,
            sampling=SamplingParamsMsg(64, 0.7, 0.95, 50, None, [2]),
        )
        for i in range(num_new)
    ]
    running = [f"req-run-{i}" for i in range(num_requests - num_new)]
    cached = CachedRequestsMsg(
        req_ids=running,
        new_token_ids=[[(step_id * 31 + i) % 32000] for i in range(len(running))],
        new_block_ids=[
            [[900 + i], [9900 + i]] if i % 16 == 0 else None for i in range(len(running))
        ],
        num_computed_tokens=[300 + i for i in range(len(running))],
    )
    scheduled = {r.req_id: prefill_tokens for r in new} | dict.fromkeys(running, 1)
    return SchedulerOutputMsg(
        step_id=step_id,
        new_requests=new,
        cached=cached,
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        finished_req_ids=[f"req-done-{step_id}"],
    )


def make_runner_output(step: SchedulerOutputMsg) -> ModelRunnerOutputMsg:
    req_ids = [r.req_id for r in step.new_requests] + step.cached.req_ids
    return ModelRunnerOutputMsg(step.step_id, req_ids, [[i % 32000] for i in range(len(req_ids))])


@ray.remote(num_cpus=0)
class Worker:
    def __init__(self, rank: int):
        self.rank = rank
        self.decoder = msgspec.msgpack.Decoder(SchedulerOutputMsg)

    def ready(self) -> bool:
        return True

    # Ray-call path: the message arrives as an argument.
    def step(self, msg):
        if isinstance(msg, bytes):
            msg = self.decoder.decode(msg)
        return make_runner_output(msg) if self.rank == 0 else None

    # Channel path: connect, then serve steps until the publisher closes.
    def connect(self, step_address: str, result_address: str) -> bool:
        self.steps = StepSubscriber(step_address, SchedulerOutputMsg)
        self.results = ResultSender(result_address, rank=self.rank)
        return True

    def serve(self) -> int:
        served = 0
        while True:
            try:
                msg = self.steps.recv()
            except ChannelClosed:
                break
            if self.rank == 0:
                self.results.send(make_runner_output(msg))
            served += 1
        self.steps.close()
        self.results.close()
        return served


def summarize(samples_s: list[float]) -> dict:
    us = sorted(s * 1e6 for s in samples_s)

    def pct(p: float) -> float:
        return us[min(len(us) - 1, round(p / 100 * (len(us) - 1)))]

    return {
        "n": len(us),
        "mean_us": statistics.fmean(us),
        "p50_us": pct(50),
        "p90_us": pct(90),
        "p99_us": pct(99),
        "min_us": us[0],
    }


def bench_channel(workers, transport: str, steps: list, warmup: int) -> list[float]:
    with (
        StepPublisher(len(workers), transport=transport, ready_timeout=120) as pub,
        ResultChannel(ModelRunnerOutputMsg, transport=transport) as results,
    ):
        ray.get([w.connect.remote(pub.address, results.address) for w in workers])
        serving = [w.serve.remote() for w in workers]
        pub.wait_ready(timeout=120)
        times = []
        for i, msg in enumerate(steps):
            start = time.perf_counter()
            pub.publish(msg)
            out = results.recv(timeout=60)
            elapsed = time.perf_counter() - start
            if out.step_id != msg.step_id:
                raise RuntimeError(f"answer for step {out.step_id} to step {msg.step_id}")
            if i >= warmup:
                times.append(elapsed)
        pub.close()
        served = ray.get(serving, timeout=60)
    if served != [len(steps)] * len(workers):
        raise RuntimeError(f"workers served {served} steps, expected {len(steps)} each")
    return times


def bench_ray_calls(workers, steps: list, warmup: int, pre_encode: bool) -> list[float]:
    encoder = msgspec.msgpack.Encoder()
    times = []
    for i, msg in enumerate(steps):
        start = time.perf_counter()
        arg = encoder.encode(msg) if pre_encode else msg
        outs = ray.get([w.step.remote(arg) for w in workers])
        elapsed = time.perf_counter() - start
        if outs[0].step_id != msg.step_id:
            raise RuntimeError(f"answer for step {outs[0].step_id} to step {msg.step_id}")
        if i >= warmup:
            times.append(elapsed)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="path of the JSON result file")
    parser.add_argument("--iters", type=int, default=2000, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=200, help="untimed steps per variant")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per step")
    parser.add_argument("--num-workers", type=int, default=2, help="worker actors")
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs given to ray.init")
    args = parser.parse_args(argv)
    for name in ("iters", "num_requests", "num_workers", "num_cpus"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        raise ValueError("--warmup must be >= 0")

    steps = [make_scheduler_output(i, args.num_requests) for i in range(args.warmup + args.iters)]
    step_bytes = len(msgspec.msgpack.encode(steps[0]))
    answer_bytes = len(msgspec.msgpack.encode(make_runner_output(steps[0])))

    # Actors import this module by name to unpickle the Worker class and the message types.
    here = os.path.dirname(os.path.abspath(__file__))
    connect_ray(  # an embedded Ray on loopback, as kvloom serve starts it
        args.num_cpus,
        log_to_driver=False,
        job_config=ray.job_config.JobConfig(code_search_path=[here]),
    )
    try:
        workers = [Worker.remote(r) for r in range(args.num_workers)]
        ray.get([w.ready.remote() for w in workers])
        results = {}
        for transport in ("tcp", "ipc"):
            results[f"channel/{transport}"] = summarize(
                bench_channel(workers, transport, steps, args.warmup)
            )
        results["ray/object"] = summarize(bench_ray_calls(workers, steps, args.warmup, False))
        results["ray/bytes"] = summarize(bench_ray_calls(workers, steps, args.warmup, True))
    finally:
        shutdown_ray()

    report = {
        "benchmark": "step_channel_overhead",
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "ray": ray.__version__,
            "pyzmq": zmq.__version__,
            "libzmq": zmq.zmq_version(),
            "msgspec": msgspec.__version__,
        },
        "num_workers": args.num_workers,
        "num_requests": args.num_requests,
        "step_message_bytes": step_bytes,
        "answer_message_bytes": answer_bytes,
        "iters": args.iters,
        "warmup": args.warmup,
        "results": results,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)

    ray_p50 = results["ray/object"]["p50_us"]
    print(
        f"step message {step_bytes} B, answer {answer_bytes} B, {args.num_workers} actors, "
        f"{args.iters} steps after {args.warmup} warm-up"
    )
    print(
        f"{'variant':<14}{'mean µs':>10}{'p50 µs':>10}{'p90 µs':>10}{'p99 µs':>10}{'p50 vs ray':>12}"
    )
    for name, r in results.items():
        print(
            f"{name:<14}{r['mean_us']:>10.0f}{r['p50_us']:>10.0f}{r['p90_us']:>10.0f}"
            f"{r['p99_us']:>10.0f}{r['p50_us'] / ray_p50:>11.2f}x"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    # Run through the importable module (not __main__) so Ray pickles classes by reference.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import step_channel_overhead

    sys.exit(step_channel_overhead.main())
