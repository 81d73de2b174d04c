"""Running a kvloom command in a subprocess so that a hang explains itself.

`subprocess.run(..., timeout=...)` kills a stuck child and reports only what it printed. Here
the child runs with Python's faulthandler on, and one that outlives its time gets SIGABRT:
faulthandler then writes every thread's stack to its stderr, which the failure shows.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest


def run_or_show_stacks(
    cmd: list[str], timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)`, failing the test with the
    child's output and thread stacks if it runs longer than `timeout` seconds."""
    env = dict(os.environ if env is None else env, PYTHONFAULTHANDLER="1")
    process = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        try:
            stdout, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        pytest.fail(
            f"{' '.join(cmd[2:])} ran past {timeout} s; its stdout:\n{stdout}\n"
            f"its stderr (with every thread's stack):\n{stderr[-20000:]}"
        )
    return subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)
