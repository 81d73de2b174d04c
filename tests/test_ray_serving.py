"""The Ray-served path end to end: a real gRPC server whose scheduler and workers are Ray
actors (an embedded local Ray on 127.0.0.1), real gRPC clients.

- A burst of 500 concurrent streams streams: every stream gets its tokens step by step
  (not in one delta at the end), and the same tokens as the requests run offline.
- A worker or scheduler actor killed with SIGKILL mid-stream ends every stream in flight
  with UNAVAILABLE within 10 s, readiness goes NOT_SERVING, and (policy "restart") the
  server rebuilds the replica and serves correctly again; with policy "exit" it stops
  with its failure recorded (`kvloom serve` then exits non-zero).
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import time

import grpc
import psutil
import pytest

from kvloom import LLM, SamplingParams
from kvloom.client import AsyncClient, Client, GenerateDelta, ServerError, collect
from kvloom.cluster.frontend import BackgroundServer, ServerOptions, engine_factory

pytestmark = pytest.mark.slow

ENGINE = dict(
    dtype="float64",
    block_size=16,
    max_model_len=128,
    num_kv_blocks=2048,
    max_num_seqs=512,
    executor="ray",
)
READINESS = "kvloom.v1.Generation"
NUM_STREAMS = 500
MAX_TOKENS = 32


def prompt_ids(i: int) -> list[int]:
    return [5 + (i * 37 + j * 11) % 500 for j in range(8 + i % 9)]


def greedy(max_tokens: int) -> dict:
    return dict(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def wait_for(predicate, timeout_s: float) -> float | None:
    """Seconds until `predicate()` held, or None if it did not within the timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            if predicate():
                return time.monotonic() - start
        except ServerError:
            pass
        time.sleep(0.05)
    return None


def actor_pids(class_name: str) -> list[int]:
    """Processes of this test's embedded Ray that host actors of `class_name`."""
    pids = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if any(f"ray::{class_name}" in part for part in proc.cmdline()):
                pids.append(proc.pid)
        except psutil.Error:
            continue
    return pids


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def expected(model_dir):
    llm = LLM(model=model_dir, progress=False, **{**ENGINE, "executor": "inprocess"})
    prompts = [{"prompt_token_ids": prompt_ids(i)} for i in range(NUM_STREAMS)]
    outs = llm.generate(prompts, SamplingParams(**greedy(MAX_TOKENS)))
    return [o.outputs[0].token_ids for o in outs]


def start_server(model_dir: str, policy: str) -> BackgroundServer:
    options = ServerOptions(
        model=model_dir, host="127.0.0.1", port=0, max_waiting=1024, on_worker_failure=policy
    )
    factory = engine_factory(model=model_dir, progress=False, **ENGINE)
    return BackgroundServer(factory, options).start()


@pytest.fixture(scope="module")
def served(model_dir):
    from kvloom.cluster.ray_local import shutdown_ray

    server = start_server(model_dir, "restart")
    yield server
    server.stop()
    shutdown_ray()


async def run_burst(address: str, n: int) -> tuple[list, float]:
    """n concurrent greedy streams; per stream (token ids, deltas, first-delta time, status)."""
    async with AsyncClient(address, timeout=300) as client:
        start = time.monotonic()

        async def one(i: int):
            ids, deltas, first = [], 0, None
            try:
                async for event in client.generate(prompt_ids(i), **greedy(MAX_TOKENS)):
                    if isinstance(event, GenerateDelta):
                        first = first if first is not None else time.monotonic() - start
                        deltas += 1
                        ids += event.token_ids
            except ServerError as err:
                return ids, deltas, first, err.code, time.monotonic() - start
            return ids, deltas, first, grpc.StatusCode.OK, time.monotonic() - start

        results = await asyncio.gather(*(one(i) for i in range(n)))
        return results, time.monotonic() - start


def test_a_burst_of_streams_streams_and_loses_nothing(served, expected):
    results, wall = asyncio.run(run_burst(served.address, NUM_STREAMS))
    assert [r[3] for r in results] == [grpc.StatusCode.OK] * NUM_STREAMS
    assert [r[0] for r in results] == expected  # nothing lost, duplicated or reordered
    deltas = statistics.median(r[1] for r in results)
    ttft = statistics.median(r[2] for r in results)
    print(f"{NUM_STREAMS} streams: wall {wall:.2f} s, median TTFT {ttft:.2f} s, deltas {deltas}")
    assert deltas >= 8, f"median deltas per stream {deltas}: the streams do not stream"
    assert ttft <= 0.5 * wall, f"median TTFT {ttft:.2f} s of a {wall:.2f} s burst"
    stats = served.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"], stats


def kill_mid_stream(server: BackgroundServer, pids: list[int]) -> None:
    """Starts streams, SIGKILLs the processes once tokens flow, and checks that every
    stream ends UNAVAILABLE, with a message free of Ray internals, within 10 s."""

    async def scenario():
        async with AsyncClient(server.address, timeout=120) as client:
            flowing = asyncio.Event()

            async def one(i: int):
                try:
                    async for event in client.generate(prompt_ids(i), **greedy(100)):
                        if isinstance(event, GenerateDelta):
                            flowing.set()
                except ServerError as err:
                    return err, time.monotonic()
                return None, time.monotonic()

            tasks = [asyncio.ensure_future(one(i)) for i in range(20)]
            await asyncio.wait_for(flowing.wait(), 60)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            ends = await asyncio.gather(*tasks)
            return killed, ends

    killed, ends = asyncio.run(scenario())
    errors = [err for err, _ in ends]
    assert all(err is not None for err in errors), "a stream ended OK after its worker died"
    assert {err.code for err in errors} == {grpc.StatusCode.UNAVAILABLE}
    for err in errors:
        assert "ray::" not in err.details and "RayTaskError" not in err.details, err.details
        assert "actor" not in err.details.lower(), err.details  # Ray's words, not ours
        assert "replica" in err.details, err.details
    assert max(t for _, t in ends) - killed < 10


@pytest.mark.parametrize("class_name", ["WorkerActor", "SchedulerActor"])
def test_a_killed_actor_fails_streams_then_the_replica_restarts(served, class_name):
    pids = actor_pids(class_name)
    assert pids, f"no ray::{class_name} process found"
    with Client(served.address, timeout=60) as client:
        kill_mid_stream(served, pids)
        assert wait_for(lambda: client.health(READINESS) == "NOT_SERVING", 10) is not None
        assert client.health("") == "SERVING"  # liveness: the process is fine, restarting
        with pytest.raises(ServerError) as info:
            collect(client.generate([5, 6], max_tokens=2))
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert "restarting" in info.value.details or "not ready" in info.value.details
        assert wait_for(lambda: client.health(READINESS) == "SERVING", 120) is not None
        result = collect(client.generate(prompt_ids(3), **greedy(MAX_TOKENS)))
    reference = LLM(
        model=served.server.options.model, progress=False, **{**ENGINE, "executor": "inprocess"}
    )
    expected = (
        reference.generate(
            {"prompt_token_ids": prompt_ids(3)}, SamplingParams(**greedy(MAX_TOKENS))
        )[0]
        .outputs[0]
        .token_ids
    )
    assert result.token_ids == expected
    stats = served.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    assert served.server.num_restarts >= 1


@pytest.mark.parametrize("class_name", ["WorkerActor", "SchedulerActor"])
def test_exit_policy_stops_the_server_with_the_failure(model_dir, served, class_name):
    others = set(actor_pids(class_name))  # the module server's: left alone
    server = start_server(model_dir, "exit")
    try:
        pids = [pid for pid in actor_pids(class_name) if pid not in others]
        assert pids, f"no ray::{class_name} process of the new server found"
        kill_mid_stream(server, pids)
        assert wait_for(lambda: server.server.stopping, 30) is not None
        assert server.server.failure is not None and "failed" in server.server.failure
    finally:
        server.stop()
