"""`benchmarks/gpu_fast_path.sh all-gpu-tests` is issue 23's "every gpu test file in one
call": it must name every test file that has a `gpu`-marked test (a file added without
its line there would never run on the GPU), and only files that exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def all_gpu_tests_section() -> set[str]:
    script = (ROOT / "benchmarks" / "gpu_fast_path.sh").read_text()
    section = re.search(r"\n\s*all-gpu-tests\)(.*?)\n\s*;;", script, re.S)
    assert section, "gpu_fast_path.sh has no all-gpu-tests section"
    return set(re.findall(r"tests/[\w/]+\.py", section.group(1)))


def files_with_gpu_tests() -> set[str]:
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu"]
        + ["-p", "no:cacheprovider", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    ids = [line for line in collected.stdout.splitlines() if "::" in line]
    assert ids, f"collected no gpu test at all: {collected.stdout[-2000:]}{collected.stderr}"
    return {line.split("::")[0] for line in ids}


def test_every_file_with_a_gpu_test_runs_in_all_gpu_tests():
    listed = all_gpu_tests_section()
    missing = sorted(files_with_gpu_tests() - listed)
    assert not missing, f"add to gpu_fast_path.sh's all-gpu-tests groups: {missing}"


def test_all_gpu_tests_names_only_existing_files():
    gone = sorted(f for f in all_gpu_tests_section() if not (ROOT / f).is_file())
    assert not gone, gone
