"""The embedded Ray's start-up (cluster/ray_local.py): a start that timed out is tried
again up to START_ATTEMPTS times; any other failure is reported at once; the metrics-port
variables are set for `ray.init` only; its workers run at the driver's niceness. `ray.init`
is faked except in the last test, which starts a real Ray."""

from __future__ import annotations

import os

import pytest

from kvloom.cluster import ray_local

TIMEOUT = "The current node timed out during startup. This could happen because ..."


@pytest.fixture
def fake_init(monkeypatch):
    """Makes `ray.init` fail with the given messages in turn, then succeed."""
    import ray

    calls: list[dict] = []

    def install(failures: list[str]) -> list[dict]:
        def init(*args, **kwargs):
            ports = {name: os.environ.get(name) for name in ray_local._METRICS_PORT_VARIABLES}
            calls.append({**kwargs, "metrics_ports": ports})
            if len(calls) <= len(failures):
                raise Exception(failures[len(calls) - 1])

        monkeypatch.setattr(ray, "init", init)
        monkeypatch.setattr(ray, "shutdown", lambda: None)
        monkeypatch.setattr(ray_local, "RETRY_PAUSE_S", 0.0)
        monkeypatch.setattr(ray_local, "_embedded", None)
        return calls

    return install


def test_timed_out_starts_are_retried_until_one_succeeds(fake_init, caplog):
    calls = fake_init([TIMEOUT] * (ray_local.START_ATTEMPTS - 1))
    ray_local._start_local(1, {})
    assert len(calls) == ray_local.START_ATTEMPTS
    retries = [r for r in caplog.records if "trying again" in r.getMessage()]
    assert len(retries) == ray_local.START_ATTEMPTS - 1
    ray_local._embedded = None  # nothing was started: leave no handle to shut down


def test_a_start_that_keeps_timing_out_fails_with_advice(fake_init):
    calls = fake_init([TIMEOUT] * ray_local.START_ATTEMPTS)
    with pytest.raises(ray_local.RayStartError, match="did not come up in time"):
        ray_local._start_local(1, {})
    assert len(calls) == ray_local.START_ATTEMPTS


def test_a_gcs_that_never_publishes_its_port_is_waited_for_briefly_and_retried(
    fake_init, monkeypatch
):
    """Ray polls a file for the GCS's port and never looks at the process: a GCS that hung
    at start cost a CI quickstart the whole wait. Each attempt waits GCS_PORT_WAIT_S (the
    operator's value if set), and Ray's message for that wait counts as a timeout."""
    monkeypatch.delenv(ray_local.GCS_PORT_WAIT_VARIABLE, raising=False)
    message = "Timed out waiting for file /tmp/ray/session_x/gcs_server_port_ffff"
    calls = fake_init([message])
    waits = []
    import ray

    faked = ray.init
    monkeypatch.setattr(
        ray,
        "init",
        lambda *a, **k: (
            waits.append(os.environ[ray_local.GCS_PORT_WAIT_VARIABLE]),
            faked(*a, **k),
        ),
    )
    ray_local._start_local(1, {})
    ray_local._embedded = None
    assert len(calls) == 2
    assert waits == [str(ray_local.GCS_PORT_WAIT_S)] * 2
    assert ray_local.GCS_PORT_WAIT_S * ray_local.START_ATTEMPTS < 240  # retries fit a test
    monkeypatch.setenv(ray_local.GCS_PORT_WAIT_VARIABLE, "200")
    calls.clear()
    waits.clear()
    ray_local._start_local(1, {})
    ray_local._embedded = None
    assert waits[0] == "200"


def test_other_failures_are_not_retried(fake_init):
    calls = fake_init(["No space left on device"])
    with pytest.raises(ray_local.RayStartError, match="full"):
        ray_local._start_local(1, {})
    assert len(calls) == 1


def test_metrics_ports_are_free_ones_during_init_only(fake_init, monkeypatch):
    """A child process started after the embedded Ray (a `kvloom serve` subprocess) must
    not inherit this Ray's metrics ports as if an operator had chosen them."""
    for name in ray_local._METRICS_PORT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    calls = fake_init([TIMEOUT])
    ray_local._start_local(1, {})
    ray_local._embedded = None
    seen = [call["metrics_ports"] for call in calls]
    assert all(port and int(port) > 0 for ports in seen for port in ports.values())
    assert not any(name in os.environ for name in ray_local._METRICS_PORT_VARIABLES)


def test_the_operators_metrics_ports_are_kept(fake_init, monkeypatch):
    monkeypatch.setenv("AUTOSCALER_METRIC_PORT", "45001")
    monkeypatch.delenv("DASHBOARD_METRIC_PORT", raising=False)
    calls = fake_init([])
    ray_local._start_local(1, {})
    ray_local._embedded = None
    assert calls[0]["metrics_ports"]["AUTOSCALER_METRIC_PORT"] == "45001"
    assert os.environ["AUTOSCALER_METRIC_PORT"] == "45001"
    assert "DASHBOARD_METRIC_PORT" not in os.environ


def test_the_operators_worker_niceness_is_kept(fake_init, monkeypatch):
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    calls = fake_init([])
    ray_local._start_local(1, {})
    assert calls[0]["_system_config"] == {"worker_niceness": 0}
    monkeypatch.setenv("RAY_worker_niceness", "15")
    calls.clear()
    ray_local._start_local(1, {})
    ray_local._embedded = None
    assert "_system_config" not in calls[0]


def test_the_embedded_rays_actors_run_at_the_drivers_niceness(monkeypatch):
    """Ray nices its workers to 15; kvloom's actors are the engine, and niced they starved
    beside any busy process (a quickstart did not start its engine within 100 s)."""
    import ray

    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray_local.shutdown_ray()
    ray_local.connect_ray(num_cpus_for_local=1)
    try:
        niceness = ray.remote(num_cpus=0)(lambda: os.nice(0))
        assert ray.get(niceness.remote(), timeout=60) == os.nice(0)
    finally:
        ray_local.shutdown_ray()
