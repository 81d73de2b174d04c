"""Runs the dense kernel checks in a fresh process when this one cannot interpret them
(triton was imported for the compiler before the conftest could set TRITON_INTERPRET=1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECKS_IN_SUBPROCESS_ENV = "KVLOOM_TRITON_CHECKS_IN_SUBPROCESS"  # set by the conftest
DENSE_CHECKS = Path(__file__).with_name("test_kernels_triton_dense.py")


def test_dense_kernel_checks_in_fresh_process():
    if os.environ.get(CHECKS_IN_SUBPROCESS_ENV) != "1":
        pytest.skip("this process runs the checks itself (test_kernels_triton_dense.py)")
    env = {k: v for k, v in os.environ.items() if k != CHECKS_IN_SUBPROCESS_ENV}
    env["TRITON_INTERPRET"] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(DENSE_CHECKS)],
        cwd=DENSE_CHECKS.parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-4000:]
