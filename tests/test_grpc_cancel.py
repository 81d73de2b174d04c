"""Cancellation both ways over real gRPC: a client that cancels its stream, a deadline that
passes, and the Abort RPC each abort the engine request and free its KV blocks; a full
queue answers RESOURCE_EXHAUSTED; a request id in use answers ALREADY_EXISTS."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from kvloom.client import Client, Finish, GenerateDelta, ServerError, Usage, collect
from kvloom.cluster.frontend import BackgroundServer, ServerOptions, engine_factory

# Long requests (ignore_eos, many tokens) so there is time to cancel them mid-stream.
LONG = dict(max_tokens=400, temperature=0.0, ignore_eos=True)


def start_server(model_dir: str, **options) -> BackgroundServer:
    engine = dict(dtype="float32", block_size=4, max_model_len=512, num_kv_blocks=1024)
    engine.update(options.pop("engine", {}))
    opts = ServerOptions(model=model_dir, host="127.0.0.1", port=0, **options)
    return BackgroundServer(engine_factory(model=model_dir, progress=False, **engine), opts).start()


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def server(model_dir):
    s = start_server(model_dir)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=60) as c:
        yield c


def wait_until_idle(server: BackgroundServer, timeout_s: float = 20.0) -> dict:
    """The engine's stats once nothing runs and every block is free (or the last seen)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server.stats()
        idle = stats["num_running"] == stats["num_waiting"] == stats["num_in_flight"] == 0
        if (
            idle and stats["num_free_blocks"] == stats["num_blocks"]
        ) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def assert_blocks_held(server: BackgroundServer) -> None:
    stats = server.stats()
    assert stats["num_running"] == 1 and stats["num_free_blocks"] < stats["num_blocks"], stats


def test_cancelled_stream_frees_its_blocks(server, client):
    before = server.stats()["num_aborted"]
    stream = client.generate([5, 6, 7, 8, 9], request_id="cancel-me", **LONG)
    got = 0
    for event in stream:
        got += isinstance(event, GenerateDelta)
        if got == 3:
            assert_blocks_held(server)
            break
    stream.close()  # leaving the iterator cancels the RPC
    stats = wait_until_idle(server)
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    assert stats["num_aborted"] == before + 1


def test_deadline_aborts_the_request(server, client):
    before = server.stats()["num_aborted"]
    with pytest.raises(ServerError) as info:
        collect(client.generate([11, 12, 13], timeout=0.5, max_tokens=100000, ignore_eos=True))
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    stats = wait_until_idle(server)
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    assert stats["num_aborted"] == before + 1


def _consume_in_thread(stream, events: list, started: threading.Event) -> threading.Thread:
    def run():
        for event in stream:
            events.append(event)
            if isinstance(event, GenerateDelta) and event.token_ids:
                started.set()
        started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_abort_rpc_ends_the_stream_and_frees_blocks(server, client):
    streams = {}
    for rid in ("ab-1", "ab-2"):
        events: list = []
        started = threading.Event()
        thread = _consume_in_thread(
            client.generate([5, 6, 7], request_id=rid, **LONG), events, started
        )
        assert started.wait(30)
        streams[rid] = (events, thread)
    assert server.stats()["num_running"] == 2
    with Client(server.address, timeout=30) as router:  # a caller that does not own the streams
        aborted = router.abort("ab-1", "unknown-id", "ab-2", "ab-1")
        assert sorted(aborted) == ["ab-1", "ab-2"]
        for rid, (events, thread) in streams.items():
            thread.join(30)
            assert not thread.is_alive()
            assert isinstance(events[-2], Finish) and events[-2].reason == "abort"
            assert isinstance(events[-1], Usage)
            result = collect(events)
            assert result.request_id == rid
            assert 0 < result.usage.completion_tokens == len(result.token_ids) < LONG["max_tokens"]
        assert router.abort("ab-1", "ab-2") == []  # idempotent: already finished
    stats = wait_until_idle(server)
    assert stats["num_free_blocks"] == stats["num_blocks"], stats


def test_request_id_in_use_is_already_exists(server, client):
    events: list = []
    started = threading.Event()
    thread = _consume_in_thread(client.generate([5, 6], request_id="dup", **LONG), events, started)
    assert started.wait(30)
    with pytest.raises(ServerError) as info:
        collect(client.generate([5, 6], request_id="dup", max_tokens=2))
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert info.value.details.startswith("request_id:")
    assert client.abort("dup") == ["dup"]
    thread.join(30)
    assert collect(events).finish_reason == "abort"
    wait_until_idle(server)
    # The id is free again once its request has finished.
    assert (
        collect(client.generate([5, 6], request_id="dup", max_tokens=2)).finish_reason == "length"
    )


def test_full_queue_is_resource_exhausted_and_recovers(model_dir):
    """max_num_seqs=1 plus --max-queue 1: two requests in flight; a third is refused."""
    server = start_server(model_dir, max_waiting=1, engine=dict(max_num_seqs=1))
    try:
        with Client(server.address, timeout=60) as client:
            threads = []
            for rid in ("q-1", "q-2"):
                events: list = []
                thread = threading.Thread(
                    target=lambda r=rid, ev=events: ev.extend(
                        client.generate([5, 6], request_id=r, **LONG)
                    ),
                    daemon=True,
                )
                thread.start()
                threads.append(thread)
            deadline = time.monotonic() + 30
            while server.stats()["num_in_flight"] < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            with pytest.raises(ServerError) as info:
                collect(client.generate([5, 6], max_tokens=2))
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert sorted(client.abort("q-1", "q-2")) == ["q-1", "q-2"]
            for thread in threads:
                thread.join(30)
            stats = wait_until_idle(server)
            assert stats["num_free_blocks"] == stats["num_blocks"], stats
            assert collect(client.generate([5, 6], max_tokens=3)).finish_reason == "length"
    finally:
        server.stop()
