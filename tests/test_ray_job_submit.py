"""`ray job submit` against a `ray start --head` cluster serves a request end to end:
the job runs `kvloom quickstart`, which joins the cluster through RAY_ADDRESS, starts the
scheduler and worker actors there, serves gRPC and streams a chat."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    head = run(
        [
            str(bin_dir / "ray"),
            "start",
            "--head",
            f"--port={gcs_port}",
            "--num-cpus=8",
            "--include-dashboard=true",
            f"--dashboard-port={dash_port}",
            "--dashboard-host=127.0.0.1",
            f"--temp-dir={ray_tmp}",
        ],
        env,
        120,
    )
    try:
        assert head.returncode == 0, (head.stdout + head.stderr)[-4000:]
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
        run([str(bin_dir / "ray"), "stop", "--force"], env, 120)
        shutil.rmtree(ray_tmp, ignore_errors=True)
