"""Hostile input cannot starve the front door: two 40 MB prompts and a chat template that
loops 10^10 times, all in flight, delay another client's small request by under 2 s; the
loop's render is stopped at the server's time limit (its worker replaced); SIGTERM stops a
server whose render worker is spinning within the drain timeout plus 10 s, workers included."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from kvloom.cluster.frontend.errors import InvalidArgument
from kvloom.cluster.frontend.limits import FrontendLimits, json_depth, parse_json
from kvloom.cluster.frontend.render_pool import RenderPool, WorkerFailed
from kvloom.protos.kvloom.v1 import generation_pb2 as pb
from kvloom.protos.kvloom.v1 import generation_pb2_grpc as pb_grpc
from tests.bad_requests import spinning_model
from tests.test_serve_lifecycle import alive, env, process_tree, psutil_module, stop

HUGE = 40 * 1024 * 1024


def spin_chat() -> pb.ChatRequest:
    return pb.ChatRequest(
        messages=[pb.ChatMessage(role="user", content="hi")],
        chat_template_kwargs='{"spin": true}',
        sampling=pb.SamplingParams(max_tokens=2),
    )


def small_generate(stub) -> float:
    begun = time.monotonic()
    request = pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(max_tokens=2))
    responses = list(stub.Generate(request, timeout=30))
    assert responses[-1].usage.completion_tokens == 2
    return time.monotonic() - begun


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory):
    return str(spinning_model(tiny_model("llama"), tmp_path_factory.mktemp("spin") / "m"))


def serve(model_dir: str, drain_s: float = 30.0) -> tuple[subprocess.Popen, int]:
    """`kvloom serve` in a process of its own (clients in this one), in-process engine."""
    command = [
        sys.executable, "-m", "kvloom.cluster.cli", "serve", "--model", model_dir,
        "--executor", "inprocess", "--port", "0", "--max-model-len", "4096",
        "--num-kv-blocks", "64", "--drain-timeout", str(drain_s), "--log-level", "WARNING",
    ]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env()
    )
    line = process.stdout.readline()
    if "serving" not in line:
        stop(process)
        raise AssertionError(f"no serving line: {line!r}; stderr: {process.stderr.read()}")
    return process, int(line.rsplit(":", 1)[1])


def render_workers(process: subprocess.Popen) -> list:
    """The server's live render workers; one may exit between listing and reading its
    command line (the killed worker being replaced), and then it is not counted."""
    psutil = psutil_module()
    workers = []
    for p in alive(process_tree(process.pid)):
        try:
            if "render_worker" in " ".join(p.cmdline()):
                workers.append(p)
        except psutil.Error:
            pass
    return workers


def client(port: int) -> tuple[grpc.Channel, pb_grpc.GenerationStub]:
    """A client on a connection of its own (its own subchannel pool): the small request
    must not queue behind the huge ones' bytes on one shared HTTP/2 connection."""
    options = [
        ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ("grpc.use_local_subchannel_pool", 1),
    ]
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=options)
    return channel, pb_grpc.GenerationStub(channel)


def test_huge_prompts_and_a_runaway_template_do_not_starve_a_small_request(model_dir):
    process, port = serve(model_dir)
    clients = [client(port) for _ in range(4)]
    try:
        stub = clients[0][1]
        baseline = min(small_generate(stub) for _ in range(3))
        results: dict[str, tuple] = {}

        def hostile(name: str, call) -> None:
            begun = time.monotonic()
            try:
                list(call())
                results[name] = ("OK", "", time.monotonic() - begun)
            except grpc.RpcError as exc:
                results[name] = (exc.code().name, exc.details(), time.monotonic() - begun)

        huge = pb.GenerateRequest(text="x" * HUGE, sampling=pb.SamplingParams(max_tokens=2))
        spin_stub, huge1, huge2 = (c[1] for c in clients[1:])
        calls = {
            "spin": lambda: spin_stub.Chat(spin_chat(), timeout=60),
            "huge1": lambda: huge1.Generate(huge, timeout=5),
            "huge2": lambda: huge2.Generate(huge, timeout=5),
        }
        threads = [threading.Thread(target=hostile, args=item) for item in calls.items()]
        for thread in threads:
            thread.start()
        time.sleep(0.5)  # all three are in flight; the loop is rendering
        loaded = small_generate(stub)
        for thread in threads:
            thread.join(60)
        print(f"small request {loaded:.3f} s under load, {baseline:.3f} s idle; {results}")
        assert loaded - baseline < 2.0, (loaded, baseline, results)
        for name in ("huge1", "huge2"):
            code, details, elapsed = results[name]
            assert code == "INVALID_ARGUMENT" and details.startswith("text: too large"), details
            assert elapsed < 4.0, elapsed  # refused unread (the time is the 40 MB transfer)
        code, details, elapsed = results["spin"]
        assert code == "DEADLINE_EXCEEDED" and details.startswith("messages:"), details
        limit_s = FrontendLimits().render_timeout_s
        assert limit_s - 0.5 < elapsed < limit_s + 3.0, elapsed
        # The killed worker is replaced: two live workers, and chats render again.
        deadline = time.monotonic() + 30
        while len(render_workers(process)) != 2:
            assert time.monotonic() < deadline, render_workers(process)
            time.sleep(0.1)
        chat = pb.ChatRequest(
            messages=[pb.ChatMessage(role="user", content="hi")],
            sampling=pb.SamplingParams(max_tokens=2),
        )
        assert list(stub.Chat(chat, timeout=30))[-1].usage.completion_tokens == 2
    finally:
        for channel, _ in clients:
            channel.close()
        stop(process)


def test_sigterm_stops_a_server_whose_render_worker_spins(model_dir):
    drain_s = 2.0
    process, port = serve(model_dir, drain_s)
    try:
        workers = render_workers(process)
        assert len(workers) == 2, workers
        channel, stub = client(port)
        outcome: dict = {}

        def spin() -> None:
            try:
                list(stub.Chat(spin_chat(), timeout=120))
            except grpc.RpcError as exc:
                outcome["code"] = exc.code()

        thread = threading.Thread(target=spin)
        thread.start()
        time.sleep(1.0)  # the render is looping in a worker now
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(drain_s + 10.0) == 0, process.stderr.read()
        assert time.monotonic() - signalled < drain_s + 10.0
        thread.join(30)
        channel.close()
        assert outcome.get("code") in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
        time.sleep(0.5)
        assert not alive(workers), [p.pid for p in alive(workers)]
    finally:
        stop(process)


def test_parse_json_limits_depth_without_recursing():
    assert json_depth(parse_json("f", '{"a": [1, {"b": 2}]}', 3)) == 3
    assert json_depth(parse_json("f", "7", 1)) == 0
    with pytest.raises(InvalidArgument, match="^f: JSON nested deeper than 3"):
        parse_json("f", "[[[[1]]]]", 3)
    with pytest.raises(InvalidArgument, match="^f: JSON nested deeper than 64"):
        parse_json("f", "[" * 100_000 + "]" * 100_000, 64)
    with pytest.raises(InvalidArgument, match="^f: not valid JSON"):
        parse_json("f", "{nope", 64)


def test_render_pool_replaces_killed_and_abandoned_workers(model_dir):
    """A worker that dies fails only its own job (INTERNAL, logged) and is replaced; a job
    whose caller gives up has its worker killed and replaced; close() kills every worker."""

    async def scenario() -> None:
        pool = RenderPool(model_dir, size=1, timeout_s=30.0)
        await pool.start()
        try:
            ids = await pool.encode("hello", True)
            assert ids and await pool.decode(ids, True)
            spin_args = ([{"role": "user", "content": "hi"}], None, {"spin": True}, True, False)
            (worker,) = pool._workers
            job = asyncio.ensure_future(pool.render(*spin_args))
            await asyncio.sleep(0.5)
            os.kill(worker.pid, signal.SIGKILL)  # dies under its job
            with pytest.raises(WorkerFailed, match="^messages: a render worker exited"):
                await job
            assert await pool.encode("hello", True) == ids  # its replacement
            (worker,) = pool._workers
            os.kill(worker.pid, signal.SIGKILL)
            await worker.process.wait()  # died while idle: the next job waits for another
            assert await pool.encode("hello", True) == ids
            job = asyncio.ensure_future(pool.render(*spin_args))
            await asyncio.sleep(0.5)
            job.cancel()  # the client went away: the looping worker is killed at once
            with pytest.raises(asyncio.CancelledError):
                await job
            assert await pool.encode("hello", True) == ids
            assert pool.stats()["replaced"] == 3
            pids = [w.pid for w in pool._workers]
        finally:
            await pool.close()
        assert pool.stats()["alive"] == 0
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)

    asyncio.run(scenario())
