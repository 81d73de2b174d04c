"""`kvloom serve` as a process: start-up failures exit non-zero with their cause on stderr
(invariant 11), a port in use is an error and never shared, a local server listens on
loopback only (invariant 12), and SIGTERM / Ctrl-C drain and then leave no process behind,
the embedded Ray's included."""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvloom.client import Client, collect
from kvloom.cluster.frontend.options import ServerOptions
from kvloom.cluster.frontend.ports import PortInUse, check_port_free

CLI = [sys.executable, "-m", "kvloom.cluster.cli", "serve"]
# Small and quick: no warm-up beyond the one the server does, a small KV pool.
SMALL = ["--max-model-len", "128", "--num-kv-blocks", "64", "--log-level", "WARNING"]
TREE_GONE_S = 20.0


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return str(tiny_model("llama"))


@pytest.fixture
def no_weights_dir(model_dir, tmp_path) -> str:
    out = tmp_path / "no-weights"
    out.mkdir()
    for path in Path(model_dir).iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
    return str(out)


def env(**extra: str) -> dict:
    out = dict(os.environ, PYTHONUNBUFFERED="1", GRPC_VERBOSITY="ERROR")
    out.pop("RAY_ADDRESS", None)  # the default: an embedded local Ray
    out.update(extra)
    return out


def serve_once(*args: str, timeout: float = 180, **env_extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env(**env_extra),
        stdin=subprocess.DEVNULL,
    )


def assert_start_failed(done: subprocess.CompletedProcess, *cause: str) -> str:
    """Exited non-zero (not by a signal), with one `kvloom serve: error:` line naming the
    cause, and no traceback."""
    err = done.stderr
    assert done.returncode > 0, (done.returncode, done.stdout, err)
    lines = [line for line in err.splitlines() if line.startswith("kvloom serve: error: ")]
    assert len(lines) == 1, err
    for word in cause:
        assert word in lines[0], lines[0]
    assert "Traceback" not in err, err
    assert "kvloom: stopped" not in done.stdout
    return lines[0]


def start_server(*args: str, new_session: bool = False) -> tuple[subprocess.Popen, int]:
    process = subprocess.Popen(
        [*CLI, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env(),
        start_new_session=new_session,
    )
    line = process.stdout.readline()
    match = re.search(r"serving .* at grpc://127\.0\.0\.1:(\d+)", line)
    if not match:
        process.kill()
        raise AssertionError(f"no serving line: {line!r}; stderr: {process.stderr.read()}")
    return process, int(match.group(1))


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(30)


def held_port() -> socket.socket:
    """A plain listening socket on a free loopback port (another program's server)."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder


def psutil_module():
    import importlib

    import ray  # noqa: F401 - ray ships psutil (ray/thirdparty_files), on sys.path from here

    return importlib.import_module("psutil")


def process_tree(pid: int) -> list:
    psutil = psutil_module()
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def alive(processes: list) -> list:
    psutil = psutil_module()
    out = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def listening_sockets(processes: list) -> list[tuple[str, str, int]]:
    psutil = psutil_module()
    out = []
    for p in processes:
        try:
            name = p.name()
            for conn in p.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    out.append((name, conn.laddr.ip, conn.laddr.port))
        except psutil.NoSuchProcess:
            continue
    return out


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


# ----- in-process pieces


def test_options_listen_on_loopback_and_never_share_ports(model_dir):
    options = ServerOptions(model=model_dir)
    assert options.host == "127.0.0.1"
    assert ("grpc.so_reuseport", 0) in options.grpc_options()


def test_check_port_free_names_the_port_in_use():
    holder = held_port()
    port = holder.getsockname()[1]
    try:
        with pytest.raises(PortInUse, match=f"port {port} is in use"):
            check_port_free("127.0.0.1", port)
        with pytest.raises(PortInUse, match=f"metrics port {port} is in use"):
            check_port_free("127.0.0.1", port, "metrics port")
        check_port_free("127.0.0.1", 0)  # any free port
    finally:
        holder.close()
    check_port_free("127.0.0.1", port)  # free again


# ----- start-up failures (in-process executor: cheap)


def test_no_weights_exits_nonzero_with_the_cause(no_weights_dir):
    done = serve_once("--model", no_weights_dir, "--executor", "inprocess", "--port", "0")
    assert_start_failed(done, "safetensors", no_weights_dir)


def test_bad_model_directory_and_bad_config_exit_nonzero(model_dir, tmp_path):
    done = serve_once("--model", str(tmp_path / "missing"), "--port", "0")
    assert_start_failed(done, "missing")
    bad = tmp_path / "bad-arch"
    shutil.copytree(model_dir, bad)
    config = (bad / "config.json").read_text()
    (bad / "config.json").write_text(re.sub(r'"\w+ForCausalLM"', '"NoSuchForCausalLM"', config))
    done = serve_once("--model", str(bad), "--executor", "inprocess", "--port", "0")
    assert_start_failed(done, "NoSuchForCausalLM", "not supported")


def test_port_held_by_a_plain_socket_is_an_error(model_dir):
    holder = held_port()
    port = holder.getsockname()[1]
    try:
        done = serve_once("--model", model_dir, "--executor", "inprocess", "--port", str(port))
        assert_start_failed(done, f"port {port} is in use")
        done = serve_once(
            "--model", model_dir, "--executor", "inprocess", "--port", "0",
            "--metrics-port", str(port), *SMALL,
        )  # fmt: skip
        assert_start_failed(done, f"metrics port {port} is in use")
    finally:
        holder.close()


def test_port_held_by_another_kvloom_server_is_an_error(model_dir):
    first, port = start_server(
        "--model", model_dir, "--executor", "inprocess", "--port", "0", *SMALL
    )
    try:
        begun = time.monotonic()
        done = serve_once("--model", model_dir, "--executor", "inprocess", "--port", str(port))
        assert_start_failed(done, f"port {port} is in use")
        assert time.monotonic() - begun < 60
        with Client(f"127.0.0.1:{port}", timeout=30) as client:  # the first one still serves
            assert client.health() == "SERVING"
            assert collect(client.generate([5, 6, 7], max_tokens=2)).finish_reason == "length"
        first.send_signal(signal.SIGTERM)
        assert first.wait(60) == 0, first.stderr.read()
    finally:
        stop(first)


def test_ray_start_failure_exits_nonzero_with_advice(model_dir, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")  # Ray cannot make its session directory under a file
    done = serve_once("--model", model_dir, "--port", "0", RAY_TMPDIR=str(not_a_dir))
    line = assert_start_failed(done, "could not start a local Ray", "RAY_ADDRESS")
    assert "Not a directory" in line


# ----- the default Ray executor (an embedded local Ray)


@pytest.mark.slow
def test_no_weights_exits_nonzero_with_the_cause_on_ray(no_weights_dir):
    done = serve_once("--model", no_weights_dir, "--port", "0")
    assert_start_failed(done, "safetensors", no_weights_dir)
    assert "ray::" not in done.stderr.split("kvloom serve: error: ")[1]  # no Ray internals


@pytest.mark.slow
def test_served_on_loopback_only_and_sigterm_leaves_no_process(model_dir):
    process, port = start_server("--model", model_dir, "--port", "0", *SMALL)
    try:
        with Client(f"127.0.0.1:{port}", timeout=30) as client:
            assert collect(client.generate([5, 6, 7], max_tokens=3)).finish_reason == "length"
        tree = process_tree(process.pid)
        names = {p.name() for p in tree}
        assert any("raylet" in name for name in names), names  # the embedded Ray is there
        sockets = listening_sockets(tree)
        assert ("127.0.0.1", port) in {(ip.removeprefix("::ffff:"), p) for _, ip, p in sockets}
        outside = [s for s in sockets if not is_loopback(s[1])]
        assert not outside, outside
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(TREE_GONE_S) == 0, process.stderr.read()
        while alive(tree) and time.monotonic() - signalled < TREE_GONE_S:
            time.sleep(0.2)
        assert not alive(tree), [(p.pid, p.name()) for p in alive(tree)]
        out = process.stdout.read()
        assert "kvloom: SIGTERM: draining" in out and "up to 30 s" in out, out
        assert "kvloom: stopped" in out
    finally:
        stop(process)


@pytest.mark.slow
def test_ctrl_c_through_a_pipe_drains_and_leaves_no_process(model_dir):
    # A shell job: kvloom leads its process group, and Ctrl-C signals the whole group
    # (the embedded Ray's processes included), with stdout on a pipe.
    process, _ = start_server("--model", model_dir, "--port", "0", *SMALL, new_session=True)
    try:
        tree = process_tree(process.pid)
        signalled = time.monotonic()
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(TREE_GONE_S) == 0, process.stderr.read()
        while alive(tree) and time.monotonic() - signalled < TREE_GONE_S:
            time.sleep(0.2)
        assert not alive(tree), [(p.pid, p.name()) for p in alive(tree)]
        out = process.stdout.read()
        assert "kvloom: SIGINT: draining" in out, out
        assert "kvloom: stopped" in out
        assert "Traceback" not in process.stderr.read()
    finally:
        stop(process)
