"""`kvloom serve --http-port` as a process: the OpenAI API on the same host beside gRPC, both
answering the same greedy tokens, and SIGTERM draining both doors and exiting 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import openai
import pytest

from kvloom.client import Client, collect

CLI = [sys.executable, "-m", "kvloom.cluster.cli", "serve", "--executor", "inprocess"]
SMALL = ["--max-model-len", "128", "--num-kv-blocks", "64", "--log-level", "WARNING"]


def _read_ports(process: subprocess.Popen) -> tuple[int, int]:
    grpc_port = http_port = None
    deadline = time.monotonic() + 180
    while (grpc_port is None or http_port is None) and time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        if match := re.search(r"serving .* at grpc://127\.0\.0\.1:(\d+)", line):
            grpc_port = int(match.group(1))
        if match := re.search(r"OpenAI-compatible API at http://127\.0\.0\.1:(\d+)/v1", line):
            http_port = int(match.group(1))
    if grpc_port is None or http_port is None:
        process.kill()
        raise AssertionError(f"no serving lines; stderr: {process.stderr.read()}")
    return grpc_port, http_port


@pytest.mark.slow
def test_serve_with_http_port_answers_both_doors_and_drains_on_sigterm(tiny_model):
    model = str(tiny_model("llama"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", GRPC_VERBOSITY="ERROR")
    process = subprocess.Popen(
        [*CLI, "--model", model, "--port", "0", "--http-port", "0", *SMALL],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        grpc_port, http_port = _read_ports(process)
        with openai.OpenAI(
            base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0
        ) as oai:
            out = oai.completions.create(model=model, prompt=[5, 6, 7], max_tokens=6, temperature=0)
        with Client(f"127.0.0.1:{grpc_port}", timeout=30) as client:
            by_grpc = collect(client.generate([5, 6, 7], max_tokens=6, temperature=0))
        assert out.choices[0].text == by_grpc.text
        assert out.usage.completion_tokens == len(by_grpc.token_ids)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(40) == 0, process.stderr.read()
        assert time.monotonic() - signalled < 40
        assert "kvloom: stopped" in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)


def test_a_bad_http_port_names_the_flag(tiny_model):
    done = subprocess.run(
        [*CLI, "--model", str(tiny_model("llama")), "--http-port", "70000"],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2, done.stderr
    assert "kvloom serve: error: --http-port must be an integer in [0, 65535]" in done.stderr
