"""`kvloom serve --speculative-config JSON`: a bad value is a CLI error naming the flag; n-gram
speculation over gRPC with the Ray executor gives the tokens of no speculation, and
GetServerInfo and /metrics report its drafts and accepted tokens (vLLM's metric names)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import urllib.request

import pytest

from kvloom import LLM, SamplingParams
from kvloom.client import Client, collect
from kvloom.cluster.commands.serve import engine_kwargs, flag_names, parse_speculative_config
from kvloom.cluster.frontend.metrics import render_metrics
from kvloom.cluster.spec_decode.server_info import spec_decode_fields
from kvloom.contracts.config import SpeculativeConfig

CLI = [sys.executable, "-m", "kvloom.cluster.cli", "serve"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
SMALL = ["--dtype", "float64", "--max-model-len", "128", "--num-kv-blocks", "64"]
MAX_TOKENS = 40


def env() -> dict:
    out = dict(os.environ, PYTHONUNBUFFERED="1", GRPC_VERBOSITY="ERROR")
    out.pop("RAY_ADDRESS", None)  # an embedded local Ray
    return out


def repetitive_prompts(n: int = 3) -> list[list[int]]:
    rng = random.Random(0)
    return [([5 + rng.randrange(40) for _ in range(6)] * 4)[: 20 + i] for i in range(n)]


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    # The tiny Qwen3 falls into repeats that n-gram lookup drafts (the tiny Llama does not).
    return str(tiny_model("qwen3"))


@pytest.mark.parametrize(
    "value, words",
    [
        ('{"method": "ngram"', ["--speculative-config must be a JSON object"]),
        ("[3]", ["--speculative-config must be a JSON object", "list"]),
        ('{"method": "medusa", "num_speculative_tokens": 2}', ["--speculative-config: method"]),
        ('{"method": "ngram", "num_speculative_tokens": 0}', ["num_speculative_tokens"]),
        ('{"method": "ngram", "num_spec": 2}', ["--speculative-config: unknown key", "num_spec"]),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', ["--speculative-config: model"]),
    ],
)
def test_a_bad_speculative_config_is_a_cli_error_naming_the_flag(model_dir, value, words):
    done = subprocess.run(
        [*CLI, "--model", model_dir, "--speculative-config", value],
        capture_output=True,
        text=True,
        timeout=120,
        env=env(),
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    errors = [line for line in done.stderr.splitlines() if line.startswith("kvloom serve: error:")]
    assert len(errors) == 1, done.stderr
    for word in words:
        assert word in errors[0]
    assert "Traceback" not in done.stderr


def test_the_flag_reaches_every_executor_and_replica_set(model_dir):
    from kvloom.cluster.cli import build_parser

    for extra in (["--executor", "inprocess"], ["--data-parallel-size", "2"], []):
        args = build_parser().parse_args(
            ["serve", "--model", model_dir, "--speculative-config", json.dumps(NGRAM), *extra]
        )
        assert engine_kwargs(args)["speculative_config"] == NGRAM
    args = build_parser().parse_args(["serve", "--model", model_dir])
    assert "speculative_config" not in engine_kwargs(args)
    assert parse_speculative_config(' {"method": "ngram"} ') == {"method": "ngram"}
    message = "speculative_config.placement must be one of ('local', 'remote'), got 'far'"
    assert flag_names(message).startswith("--speculative-config: placement must be")


def test_metrics_and_server_info_sum_the_replicas_per_position_counts():
    replica = {"spec_num_drafts": 4, "spec_drafted_tokens": 12, "spec_accepted_tokens": 5}
    stats = {
        "spec_num_drafts": 8,
        "spec_drafted_tokens": 24,
        "spec_accepted_tokens": 10,
        "replicas": [
            {**replica, "spec_accepted_tokens_per_position": [3, 2]},
            {**replica, "spec_accepted_tokens_per_position": [4, 1, 0]},
        ],
    }
    text = render_metrics(stats, True, "m")
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 8' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 10' in text
    per_pos = re.findall(r'_per_pos_total\{model_name="m",position="(\d)"\} (\d+)', text)
    assert per_pos == [("0", "7"), ("1", "3"), ("2", "0")]
    fields = spec_decode_fields(SpeculativeConfig(**NGRAM), stats)
    assert fields["accepted_tokens_per_position"] == [7, 3, 0]
    assert fields["mean_accepted_length"] == pytest.approx(1 + 10 / 8)
    assert fields["drafter_available"] is True
    stats["replicas"][1]["spec_drafter_available"] = False  # one replica's drafter is down
    assert spec_decode_fields(SpeculativeConfig(**NGRAM), stats)["drafter_available"] is False
    assert spec_decode_fields(SpeculativeConfig(), stats) is None


@pytest.fixture(scope="module")
def expected(model_dir) -> list[list[int]]:
    """Greedy tokens without speculation, in this process."""
    llm = LLM(
        model=model_dir,
        dtype="float64",
        max_model_len=128,
        num_kv_blocks=64,
        executor="inprocess",
        device="cpu",
        progress=False,
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in repetitive_prompts()], params)
    llm.engine.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def read_addresses(process: subprocess.Popen) -> tuple[int, int]:
    """The gRPC and metrics ports from `kvloom serve`'s start-up lines."""
    grpc_port = metrics_port = None
    for _ in range(10):
        line = process.stdout.readline()
        if not line:
            break
        if match := re.search(r"serving .* at grpc://127\.0\.0\.1:(\d+)", line):
            grpc_port = int(match.group(1))
        if match := re.search(r"metrics at http://127\.0\.0\.1:(\d+)/metrics", line):
            metrics_port = int(match.group(1))
        if grpc_port and metrics_port:
            return grpc_port, metrics_port
    process.kill()
    raise AssertionError(f"no serving lines; stderr: {process.stderr.read()}")


@pytest.mark.slow
def test_ngram_speculation_over_grpc_with_the_ray_executor(model_dir, expected):
    process = subprocess.Popen(
        [*CLI, "--model", model_dir, *SMALL, "--executor", "ray", "--port", "0"]
        + ["--metrics-port", "0", "--log-level", "WARNING", "--speculative-config"]
        + [json.dumps(NGRAM)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env(),
    )
    try:
        grpc_port, metrics_port = read_addresses(process)
        with Client(f"127.0.0.1:{grpc_port}", timeout=120) as client:
            got = [
                collect(
                    client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
                ).token_ids
                for p in repetitive_prompts()
            ]
            info = client.server_info()
        assert got == expected  # lossless
        spec = info.spec_decode
        assert info.HasField("spec_decode")
        assert (spec.method, spec.num_speculative_tokens, spec.placement) == ("ngram", 3, "local")
        assert spec.num_drafts > 0 and spec.num_accepted_tokens > 0, spec
        assert spec.num_draft_tokens >= spec.num_accepted_tokens
        assert sum(spec.accepted_tokens_per_position) == spec.num_accepted_tokens
        assert spec.mean_accepted_length == pytest.approx(
            1 + spec.num_accepted_tokens / spec.num_drafts
        )
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=30).read().decode()
        drafts = re.search(r"^vllm:spec_decode_num_drafts_total\{[^}]*\} (\d+)", text, re.M)
        accepted = re.search(
            r"^vllm:spec_decode_num_accepted_tokens_total\{[^}]*\} (\d+)", text, re.M
        )
        assert drafts and int(drafts.group(1)) == spec.num_drafts, text
        assert accepted and int(accepted.group(1)) == spec.num_accepted_tokens, text
        assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="' in text
        # Per request: each verified drafts, so each is in the acceptance-length histogram
        # (the server's warm-up request may be too).
        count = re.search(
            r"^kvloom_request_spec_mean_accepted_length_count\{[^}]*\} (\d+)$", text, re.M
        )
        assert count and int(count.group(1)) >= len(expected), text
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)


def drafter_pids(server_pid: int) -> list[int]:
    """Processes under the server (its embedded Ray) that host the drafter actor."""
    import psutil

    pids = []
    for proc in psutil.Process(server_pid).children(recursive=True):
        try:
            if any("ray::DrafterActor" in part for part in proc.cmdline()):
                pids.append(proc.pid)
        except psutil.Error:
            continue
    return pids


@pytest.mark.slow
def test_a_remote_drafter_killed_mid_stream_over_grpc(model_dir):
    """`kvloom serve` with the drafter in its own actor: streams in flight when its process
    is SIGKILLed all finish OK with the tokens of no speculation."""
    import signal
    import threading
    import time

    from kvloom.client import GenerateDelta

    max_tokens = 90
    prompts = repetitive_prompts()
    llm = LLM(
        model=model_dir,
        dtype="float64",
        max_model_len=128,
        num_kv_blocks=64,
        executor="inprocess",
        device="cpu",
        progress=False,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    plain = [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]
    llm.engine.shutdown()
    spec = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3}
    process = subprocess.Popen(
        [*CLI, "--model", model_dir, *SMALL, "--executor", "ray", "--port", "0"]
        + ["--metrics-port", "0", "--log-level", "WARNING", "--speculative-config"]
        + [json.dumps({**spec, "placement": "remote"})],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env(),
    )
    try:
        grpc_port, _ = read_addresses(process)
        address = f"127.0.0.1:{grpc_port}"
        with Client(address, timeout=120) as client:
            info = client.server_info().spec_decode
        assert (info.placement, info.drafter_available) == ("remote", True)
        victims = drafter_pids(process.pid)
        assert len(victims) == 1, victims
        got: dict[int, list[int]] = {}
        first_delta = threading.Event()
        failures: list[BaseException] = []

        def stream(i: int) -> None:
            try:
                with Client(address, timeout=120) as client:
                    ids = []
                    for event in client.generate(
                        prompts[i], max_tokens=max_tokens, temperature=0.0, ignore_eos=True
                    ):
                        if isinstance(event, GenerateDelta):
                            ids += event.token_ids
                            first_delta.set()
                    got[i] = ids
            except BaseException as exc:  # reported below
                failures.append(exc)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        assert first_delta.wait(60), "no stream got a token"
        os.kill(victims[0], signal.SIGKILL)
        killed_at = time.monotonic()
        unfinished = sum(len(got.get(i, [])) < max_tokens for i in range(len(prompts)))
        for thread in threads:
            thread.join(120)
        assert not failures, failures
        assert [got[i] for i in range(len(prompts))] == plain
        assert unfinished > 0, "every stream had finished before the kill"
        print(f"streams finished {time.monotonic() - killed_at:.1f} s after the kill")
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)
