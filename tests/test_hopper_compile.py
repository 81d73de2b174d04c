"""tests/hopper_compile.py builds kernels for sm_90 on the CPU: a kernel the interpreter
runs but Triton's compiler rejects (a `break`) is reported by name and test, a good one
is counted as built, and the script's exit status says which happened."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]

PROBE = """
import torch
import triton
import triton.language as tl


@triton.jit
def _double(x_ptr, y_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i) * 2)


@triton.jit
def _first_negative(x_ptr, out_ptr, n):
    found = -1
    for i in range(n):
        if tl.load(x_ptr + i) < 0:
            found = i
            break
    tl.store(out_ptr, found)


def test_double():
    x = torch.arange(16, dtype=torch.float32)
    y = torch.empty_like(x)
    _double[(1,)](x, y, BLOCK=16)
    assert torch.equal(y, x * 2)


def test_first_negative():
    x = torch.tensor([3.0, 1.0, -2.0, -5.0])
    out = torch.zeros(1, dtype=torch.int32)
    _first_negative[(1,)](x, out, 4)
    assert out.item() == 2
"""


def run_probe(tmp_path: Path, *, plugin: bool) -> subprocess.CompletedProcess:
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {**os.environ, "KVLOOM_HOPPER_COMPILE_REPORT": str(tmp_path / "report.json")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    args = [sys.executable, "-m", "pytest", "-q", "--tb=short", "-p", "no:cacheprovider"]
    if plugin:
        args += ["-p", "tests.hopper_compile"]
    else:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run(
        [*args, "--rootdir", str(tmp_path), str(tmp_path / "test_probe.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_the_interpreter_runs_both_kernels(tmp_path):
    done = run_probe(tmp_path, plugin=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_kernel_the_compiler_rejects_is_reported(tmp_path):
    done = run_probe(tmp_path, plugin=True)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["target"] == "cuda sm_90"
    assert report["kernels_built"] == {"_double": 1}
    assert 0 < report["max_registers"]["_double"] <= 255 and report["spilled_bytes"] == {}
    [failure] = report["failures"]
    assert failure["kernel"] == "_first_negative"
    assert failure["test"].endswith("test_probe.py::test_first_negative")
    assert "Break" in failure["error"]
    assert "BUILD FAILED _first_negative" in done.stdout
    # The good kernel was built, never launched: its output stays as allocated.
    assert "test_double" in done.stdout and done.returncode == 1


def test_the_script_runner_reports_a_clean_build(tmp_path):
    script = tmp_path / "launch.py"
    script.write_text(
        PROBE + "\nx = torch.arange(16, dtype=torch.float32)\n"
        "_double[(1,)](x, torch.empty_like(x), BLOCK=16)\nprint('launched')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.hopper_compile", str(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "launched" in done.stdout
    assert "1 variants of 1 kernels built, 0 failures" in done.stdout
