"""Server life cycle over real gRPC: readiness NOT_SERVING while the model loads and
SERVING after warm-up; draining (NOT_SERVING, UNAVAILABLE for new requests, in-flight
requests finish); an unexpected error is INTERNAL and the server keeps serving; an engine
that fails ends its streams UNAVAILABLE and takes the server out of service, then is
rebuilt (policy "restart") or stops the server (policy "exit"); metrics over HTTP."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from kvloom.client import Client, GenerateDelta, ServerError, collect
from kvloom.cluster.frontend import BackgroundServer, ServerOptions, build_engine, engine_factory
from kvloom.cluster.frontend import responses as responses_module

ENGINE = dict(dtype="float32", block_size=4, max_model_len=512, num_kv_blocks=512)
READINESS = "kvloom.v1.Generation"


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("llama"))


def options(model_dir: str, **kwargs) -> ServerOptions:
    return ServerOptions(model=model_dir, host="127.0.0.1", port=0, **kwargs)


def wait_for(predicate, timeout_s: float = 30.0, interval_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


def test_not_ready_until_warm_up_then_serving(model_dir):
    gate = threading.Event()

    def slow_factory():
        assert gate.wait(60), "the test never opened the gate"
        return build_engine(model=model_dir, progress=False, **ENGINE)

    server = BackgroundServer(slow_factory, options(model_dir))
    starter = threading.Thread(target=server.start, daemon=True)
    starter.start()
    try:
        assert wait_for(lambda: server.server.port)
        with Client(f"127.0.0.1:{server.server.port}", timeout=10) as client:
            assert wait_for(lambda: client.health("") == "SERVING")  # liveness: the process is up
            assert client.health(READINESS) == "NOT_SERVING"  # readiness: the model is loading
            assert client.health("no.such.Service") == "SERVICE_UNKNOWN"
            with pytest.raises(ServerError) as info:
                collect(client.generate([5, 6, 7], max_tokens=2))
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            assert client.tokenize("Hello")  # the tokenizer is loaded before the engine
            assert client.server_info().ready is False
            gate.set()
            starter.join(60)
            assert client.health(READINESS) == "SERVING"
            assert client.server_info().ready is True
            assert client.server_info().block_size == 4
            # Warm-up ran one short generation before readiness turned SERVING.
            assert server.stats()["num_finished"] == 1
            assert collect(client.generate([5, 6, 7], max_tokens=2)).finish_reason == "length"
    finally:
        gate.set()
        starter.join(60)
        server.stop()


def test_drain_finishes_in_flight_refuses_new_then_stops(model_dir):
    server = BackgroundServer(
        engine_factory(model=model_dir, progress=False, **ENGINE), options(model_dir)
    ).start()
    address = server.address
    events: list = []
    first_delta = threading.Event()
    with Client(address, timeout=60) as client:

        def consume():
            for event in client.generate(
                [5, 6, 7], max_tokens=80, temperature=0.0, ignore_eos=True
            ):
                events.append(event)
                first_delta.set()

        consumer = threading.Thread(target=consume, daemon=True)
        consumer.start()
        assert first_delta.wait(30)
        drained = server.drain(timeout_s=60)
        assert wait_for(lambda: client.health(READINESS) == "NOT_SERVING", timeout_s=10)
        assert client.health("") == "SERVING"  # alive while draining: not restarted mid-drain
        with pytest.raises(ServerError) as info:
            collect(client.generate([5, 6], max_tokens=2))
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert "draining" in info.value.details
        assert client.server_info().draining is True
        consumer.join(60)
        drained.result(60)
    result = collect(events)
    assert result.finish_reason == "length" and len(result.token_ids) == 80
    server.wait_stopped(30)
    with Client(address, timeout=5) as late, pytest.raises(ServerError) as info:
        late.health("")
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_drain_timeout_aborts_what_is_left(model_dir):
    """Requests still running when the drain time is up are aborted: each stream ends
    properly (Finish ABORT, Usage) before the server closes."""
    server = BackgroundServer(
        engine_factory(model=model_dir, progress=False, **ENGINE), options(model_dir)
    ).start()
    events: list = []
    started = threading.Event()
    with Client(server.address, timeout=120) as client:

        def consume():
            for event in client.generate([5, 6], max_tokens=100000, ignore_eos=True):
                events.append(event)
                started.set()

        consumer = threading.Thread(target=consume, daemon=True)
        consumer.start()
        assert started.wait(30)
        begun = time.monotonic()
        server.drain(timeout_s=0.3).result(30)
        assert time.monotonic() - begun < 10
        consumer.join(30)
    result = collect(events)
    assert result.finish_reason == "abort"
    assert result.usage.completion_tokens == len(result.token_ids) > 0
    server.wait_stopped(30)


@pytest.fixture
def server(model_dir):
    s = BackgroundServer(
        engine_factory(model=model_dir, progress=False, **ENGINE),
        options(model_dir, metrics_port=0),
    ).start()
    yield s
    s.stop()


def test_unexpected_error_is_internal_and_the_server_keeps_serving(server, monkeypatch):
    real_update = responses_module.GenerateResponder.update

    def update(self, out):
        if self.request_id.startswith("boom"):
            raise RuntimeError("a bug in the responder")
        return real_update(self, out)

    monkeypatch.setattr(responses_module.GenerateResponder, "update", update)
    with Client(server.address, timeout=60) as client:
        with pytest.raises(ServerError) as info:
            collect(client.generate([5, 6, 7], request_id="boom-1", max_tokens=50, ignore_eos=True))
        assert info.value.code == grpc.StatusCode.INTERNAL
        assert "a bug in the responder" in info.value.details
        assert collect(client.generate([5, 6, 7], max_tokens=3)).finish_reason == "length"
        assert client.health(READINESS) == "SERVING"
    stats = wait_for(lambda: (s := server.stats())["num_running"] == 0 and s)
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_aborted"] == 1


def test_metrics_endpoint(server):
    with Client(server.address, timeout=60) as client:
        collect(client.generate([5, 6, 7], max_tokens=3))
    url = f"http://127.0.0.1:{server.server.metrics_port}"
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        assert response.status == 200
        body = response.read().decode()
    samples = dict(line.rsplit(" ", 1) for line in body.splitlines() if not line.startswith("#"))
    assert samples["kvloom_ready"] == "1"
    assert samples["kvloom_kv_blocks"] == str(server.stats()["num_blocks"])
    assert samples["kvloom_requests_finished_total"] == "2"  # warm-up and ours
    assert "# TYPE kvloom_requests_finished_total counter" in body
    # vLLM's latency histograms and token counters, over requests the front door finished.
    label = next(k for k in samples if k.startswith("vllm:e2e_request_latency_seconds_count"))
    finished = int(samples[label])
    assert (
        finished >= 1
        and int(samples[label.replace("e2e_request_latency", "time_to_first_token")]) == finished
    )
    assert (
        int(samples[label.replace("e2e_request_latency_seconds_count", "generation_tokens_total")])
        >= 3
    )
    buckets = [
        (k, int(v))
        for k, v in samples.items()
        if k.startswith("vllm:time_to_first_token_seconds_bucket")
    ]
    counts = [n for _, n in buckets]
    assert (
        counts == sorted(counts)
        and buckets[-1][0].endswith('le="+Inf"}')
        and counts[-1] == finished
    )
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in body
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{url}/other", timeout=10)
    assert info.value.code == 404


class FailingEngine:
    """A real engine whose step raises once after `fail` is set (a device lost mid-flight)."""

    def __init__(self, engine, fail: threading.Event) -> None:
        self._engine = engine
        self._fail = fail

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step_deltas(self):
        if self._fail.is_set():
            self._fail.clear()
            raise RuntimeError("the device fell off the bus")
        return self._engine.step_deltas()


def fail_mid_stream(client: Client, fail: threading.Event) -> ServerError:
    stream = client.generate([5, 6, 7], max_tokens=1000, ignore_eos=True)
    armed = False
    with pytest.raises(ServerError) as info:
        for event in stream:
            if isinstance(event, GenerateDelta) and not armed:
                fail.set()  # once: the engine fails at its next step
                armed = True
    return info.value


def failing_factory(model_dir: str, fail: threading.Event):
    return lambda: FailingEngine(build_engine(model=model_dir, progress=False, **ENGINE), fail)


def test_engine_failure_with_policy_exit_fails_in_flight_and_stops_the_server(model_dir):
    fail = threading.Event()
    server = BackgroundServer(
        failing_factory(model_dir, fail), options(model_dir, on_worker_failure="exit")
    ).start()
    try:
        with Client(server.address, timeout=60) as client:
            error = fail_mid_stream(client, fail)
            assert error.code == grpc.StatusCode.UNAVAILABLE  # retry on another replica
            assert "the device fell off the bus" in error.details
            assert wait_for(lambda: server.server.stopping, 10)
        assert "the device fell off the bus" in server.server.failure  # kvloom serve: exit 1
    finally:
        server.stop()


def test_engine_failure_with_policy_restart_serves_again(model_dir):
    fail = threading.Event()
    server = BackgroundServer(failing_factory(model_dir, fail), options(model_dir)).start()
    # Readiness right after the failure is seen (the restart may be done before the client
    # reads its error: a tiny model reloads in milliseconds).
    ready_after_failure = []
    engine = server.server.engine
    on_fatal = engine._on_fatal

    def record(error):
        on_fatal(error)
        ready_after_failure.append(server.server.ready)

    engine._on_fatal = record
    try:
        with Client(server.address, timeout=60) as client:
            expected = collect(client.generate([5, 6], max_tokens=4, ignore_eos=True)).token_ids
            error = fail_mid_stream(client, fail)
            assert error.code == grpc.StatusCode.UNAVAILABLE
            assert ready_after_failure == [False]  # readiness NOT_SERVING at once
            assert wait_for(lambda: client.health(READINESS) == "SERVING", 60)
            assert client.health("") == "SERVING"  # liveness never dropped
            again = collect(client.generate([5, 6], max_tokens=4, ignore_eos=True))
            assert again.token_ids == expected
            assert server.server.num_restarts == 1 and server.server.failure is None
    finally:
        server.stop()
