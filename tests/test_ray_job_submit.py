"""`ray job submit` against a `ray start --head` cluster serves a request end to end:
the job runs `kvloom quickstart`, which joins the cluster through RAY_ADDRESS, starts the
scheduler and worker actors there, serves gRPC and streams a chat."""

from __future__ import annotations

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


def wait_for_dashboard(port: int, head: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise AssertionError(f"ray start exited early: {head.stdout.read()[-4000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("the Ray dashboard did not come up")


def stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run(cmd: list[str], env: dict, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_ray_job_submit_serves_end_to_end(tmp_path, demo_tokenizer_dir):
    bin_dir = Path(sys.executable).parent
    model = tmp_path / "model"
    shutil.copytree(demo_tokenizer_dir, model)
    workdir = tmp_path / "job"  # not a kvloom checkout: the job uses the installed package
    workdir.mkdir()
    gcs_port, dash_port = free_port(), free_port()
    # Ray's unix sockets live under --temp-dir, whose path must stay short (< 108 bytes).
    ray_tmp = tempfile.mkdtemp(prefix="kvray", dir="/tmp")
    # Ray 2.60 turns on token auth when a token file exists; this local cluster needs none.
    env = dict(os.environ, GRPC_VERBOSITY="ERROR", RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    # --block keeps `ray start` in the foreground; it runs in its own session so the whole
    # cluster (GCS, raylet, dashboard) is stopped by signalling that group, without
    # touching any other Ray instance on the machine (`ray stop` would stop them all).
    head = subprocess.Popen(
        [
            str(bin_dir / "ray"),
            "start",
            "--head",
            "--block",
            f"--port={gcs_port}",
            "--num-cpus=8",
            "--include-dashboard=true",
            f"--dashboard-port={dash_port}",
            "--dashboard-host=127.0.0.1",
            f"--temp-dir={ray_tmp}",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
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
        stop_group(head)
        shutil.rmtree(ray_tmp, ignore_errors=True)
