"""`ray job submit` against a `ray start --head` cluster serves a request end to end:
the job runs `kvloom quickstart`, which joins the cluster through RAY_ADDRESS, starts the
scheduler and worker actors there, serves gRPC and streams a chat.

It runs while another Ray instance runs on the same host, as on a shared machine or CI
runner. That used to fail: a Ray's dashboard agent listens on the fixed port 52365 by
default, so the second cluster's agent came up without its HTTP server, and job submission
(which the dashboard forwards to the head node's agent over HTTP) failed. Both clusters here
are on loopback and on ports of their own; the test's cluster names a free agent port.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def head_log(head: subprocess.Popen) -> str:
    return Path(head.log).read_text(errors="replace")


def wait_for_dashboard(port: int, head: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise AssertionError(f"ray start exited early: {head_log(head)[-4000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("the Ray dashboard did not come up")


def stop_groups(procs: list[subprocess.Popen], grace_s: float = 15) -> None:
    """SIGTERM to each `ray start` process group at once, SIGKILL to what is left after
    `grace_s` (never `ray stop`: it stops every Ray on the machine)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
        live = []
        for proc in procs:
            try:
                os.killpg(proc.pid, sig)
                live.append(proc)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        for proc in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        if all(proc.poll() is not None for proc in procs):
            return


def run(cmd: list[str], env: dict, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def loopback_env() -> dict:
    """The environment for a local `ray start` on 127.0.0.1 only (invariant 12)."""
    env = dict(os.environ, GRPC_VERBOSITY="ERROR", RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    # Ray resolves --node-ip-address=127.0.0.1 to the host's network address unless it is
    # told the cluster is a single machine's; and its autoscaler and dashboard metrics
    # servers have fixed ports (44217, 44227) unless these say otherwise.
    env.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        AUTOSCALER_METRIC_PORT=str(free_port()),
        DASHBOARD_METRIC_PORT=str(free_port()),
    )
    # `ray start` does not retry a slow start: on a loaded 2-core CI machine give its GCS
    # more than Ray's 30 s to come up (one CI run timed out there).
    env.setdefault("RAY_gcs_server_port_wait_time_s", "120")
    return env


def start_head(ray_tmp: str, *extra: str) -> subprocess.Popen:
    """`ray start --head --block` on 127.0.0.1 in a session of its own, so the whole
    cluster (GCS, raylet, agents) is stopped by signalling that group without touching any
    other Ray instance on the machine (`ray stop` would stop them all)."""
    log = Path(ray_tmp) / "ray-start.log"
    with log.open("w") as out:
        head = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "ray"),
                "start",
                "--head",
                "--block",
                f"--port={free_port()}",
                "--node-ip-address=127.0.0.1",
                f"--ray-client-server-port={free_port()}",  # its default is the fixed 10001
                "--disable-usage-stats",
                f"--temp-dir={ray_tmp}",
                *extra,
            ],
            env=loopback_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    head.log = str(log)
    return head


def wait_for_ray_start(head: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "Ray runtime started" in head_log(head):
            return
        if head.poll() is not None:
            break
        time.sleep(0.5)
    raise AssertionError(f"ray start did not come up: {head_log(head)[-4000:]}")


def test_ray_job_submit_serves_end_to_end(tmp_path, demo_tokenizer_dir):
    bin_dir = Path(sys.executable).parent
    model = tmp_path / "model"
    shutil.copytree(demo_tokenizer_dir, model)
    workdir = tmp_path / "job"  # not a kvloom checkout: the job uses the installed package
    workdir.mkdir()
    dash_port = free_port()
    # Ray's unix sockets live under --temp-dir, whose path must stay short (< 108 bytes).
    other_tmp = tempfile.mkdtemp(prefix="kvray", dir="/tmp")
    ray_tmp = tempfile.mkdtemp(prefix="kvray", dir="/tmp")
    env = loopback_env()
    heads: list[subprocess.Popen] = []
    try:
        # Another Ray on the host, first: with Ray's default ports it holds the dashboard
        # agent's 52365 (when free), as any other user's Ray would.
        heads.append(start_head(other_tmp, "--num-cpus=1", "--include-dashboard=false"))
        wait_for_ray_start(heads[0])
        # --block keeps `ray start` in the foreground.
        head = start_head(
            ray_tmp,
            "--num-cpus=8",
            "--include-dashboard=true",
            f"--dashboard-port={dash_port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-agent-listen-port={free_port()}",
        )
        heads.append(head)
        wait_for_dashboard(dash_port, head)
        job = run(
            [
                str(bin_dir / "ray"),
                "job",
                "submit",
                f"--address=http://127.0.0.1:{dash_port}",
                f"--working-dir={workdir}",
                "--",
                str(bin_dir / "kvloom"),
                "quickstart",
                "--model-dir",
                str(model),
                "--max-tokens",
                "8",
            ],
            env,
            300,
        )
        log = job.stdout + job.stderr
        assert job.returncode == 0, log[-4000:]
        assert "health: SERVING" in log, log[-4000:]
        assert "8 completion" in log, log[-4000:]
        assert "succeeded" in log, log[-4000:]
    finally:
        stop_groups(heads)
        shutil.rmtree(ray_tmp, ignore_errors=True)
        shutil.rmtree(other_tmp, ignore_errors=True)
