"""Static checks of the serving image's Dockerfile and .dockerignore.

No image is built here: CI machines have no Docker engine. These checks parse the
Dockerfile's instructions and hold the properties the chart relies on: a CUDA base, torch
installed before the package, a numeric non-root user (the chart's podSecurityContext runs
as 1000:1000 with runAsNonRoot), and `kvloom` as the entrypoint.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    result, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        whole = pending + stripped
        pending = ""
        keyword, _, arguments = whole.partition(" ")
        result.append((keyword.upper(), arguments.strip()))
    return result


def arg_defaults(steps: list[tuple[str, str]]) -> dict[str, str]:
    defaults = {}
    for keyword, arguments in steps:
        if keyword == "ARG" and "=" in arguments:
            name, _, value = arguments.partition("=")
            defaults[name] = value
    return defaults


def expand(text: str, defaults: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: defaults.get(m[1] or m[2], m[0]), text)


STEPS = instructions((REPO / "Dockerfile").read_text())
DEFAULTS = arg_defaults(STEPS)


def test_cuda_base_image():
    (base,) = [arguments for keyword, arguments in STEPS if keyword == "FROM"]
    assert re.fullmatch(
        r"nvidia/cuda:[0-9.]+-(cudnn-)?(base|runtime|devel)-ubuntu[0-9.]+", expand(base, DEFAULTS)
    )


def test_torch_is_installed_before_the_package():
    runs = [arguments for keyword, arguments in STEPS if keyword == "RUN"]
    torch = [i for i, run in enumerate(runs) if re.search(r"pip install \"?torch==", run)]
    package = [i for i, run in enumerate(runs) if re.search(r"pip install \.(\s|$)", run)]
    assert len(torch) == 1 and len(package) == 1, runs
    assert torch[0] < package[0]
    major, minor = expand("${TORCH_VERSION}", DEFAULTS).split(".")[:2]
    assert (int(major), int(minor)) >= (2, 11)  # the package's own floor


def test_runs_as_a_numeric_non_root_user_matching_the_chart():
    users = [expand(arguments, DEFAULTS) for keyword, arguments in STEPS if keyword == "USER"]
    assert users, "no USER instruction: the image would run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, users[-1]
    values = yaml.safe_load((REPO / "helm" / "kvloom" / "values.yaml").read_text())
    security = values["podSecurityContext"]
    assert security["runAsNonRoot"] is True
    assert (security["runAsUser"], security["runAsGroup"]) == (int(uid), int(gid))
    # The user is created after every root-only step (apt, pip into /opt/venv).
    last_user = max(i for i, (keyword, _) in enumerate(STEPS) if keyword == "USER")
    assert all(keyword != "RUN" for keyword, _ in STEPS[last_user:])


def test_entrypoint_is_kvloom():
    (entrypoint,) = [arguments for keyword, arguments in STEPS if keyword == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["kvloom"]


def test_dockerignore_keeps_the_package_and_drops_the_rest():
    patterns = {
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", "tests", "**/__pycache__"} <= patterns
    needed = {
        "pyproject.toml",
        "setup.py",
        "README.md",
        "kvloom",
        "contracts",
        "cluster",
        "workers",
        "kernels",
        "protos",
    }
    assert not needed & patterns, needed & patterns
