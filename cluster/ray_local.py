"""Joining Ray: RAY_ADDRESS's cluster, or an embedded local Ray that kvloom starts and stops.

The embedded Ray is a single-machine Ray and is treated as one (ARCHITECTURE invariant 12):

- **loopback only**: its GCS, raylet, agents, workers and the channels kvloom opens through
  it bind and advertise 127.0.0.1. (Ray 2.x turns a node address of 127.0.0.1 into the
  host's network address unless it thinks it runs on a single machine, as it does on macOS
  and Windows; it is told so for the duration of `ray.init`.)
- **lean, on free ports**: no dashboard, no usage stats; the dashboard agent's HTTP port
  (52365 by default) and the autoscaler's and dashboard's metrics ports (44217, 44227) are
  free ports picked at start, so a second Ray on the host (or a second kvloom) never
  collides with this one.
- **stopped with everything it started**: `shutdown_ray()` calls `ray.shutdown()` and then
  ends, within seconds, any process of the embedded Ray still alive (Ray's agents were seen
  to linger for a minute, reparented to init). A cluster named by RAY_ADDRESS is only
  disconnected from, never stopped.
- **its workers at the driver's priority**: Ray runs worker processes at niceness 15 so its
  driver stays responsive, but here the workers are the engine (scheduler and model actors):
  niced, any busy process on the host starved them (a quickstart's engine took over 100 s to
  start beside two busy cores instead of 26 s). `RAY_worker_niceness` stays the operator's.
- **started from a thread that outlives it** (`_HostThread`): Ray ties its processes to the
  thread that spawned them.

Start-up failures raise `RayStartError`, whose message is one line: why, and what to try;
a start that timed out (a busy machine, a GCS that never came up) is tried again first.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import inspect
import ipaddress
import logging
import os
import queue
import re
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# Fixed ports Ray's helper processes would take (their environment variables are Ray's).
_METRICS_PORT_VARIABLES = ("AUTOSCALER_METRIC_PORT", "DASHBOARD_METRIC_PORT")
# How long the embedded Ray's processes get to exit after ray.shutdown(), then after SIGTERM.
EXIT_GRACE_S = 3.0
TERMINATE_GRACE_S = 3.0
# A start that timed out is tried again: on a loaded 2-core machine the raylet was seen to
# miss Ray's fixed 30 s to register with the GCS twice in a row (CI, 2026-12-05).
START_ATTEMPTS = 3
RETRY_PAUSE_S = 2.0  # lets the stopped attempt's processes exit before the next one
# Each attempt's wait for the GCS to publish its port. Ray polls a file and never looks at
# the GCS process, so a GCS that hangs or dies at start costs the whole wait: a quickstart
# in CI (2026-12-06) sat out a 120 s wait that way and failed its test's 120 s. 45 s covers
# the slowest start seen on a loaded machine (over Ray's 30 s) and leaves room to retry.
GCS_PORT_WAIT_VARIABLE = "RAY_gcs_server_port_wait_time_s"
GCS_PORT_WAIT_S = 45


class RayStartError(RuntimeError):
    """Ray could not be started or joined; the message is one line saying why and what to try."""


class _HostThread:
    """Where `ray.init` of the embedded Ray runs: a thread that lives until `shutdown_ray`.

    Ray starts its GCS, raylet and helpers with PR_SET_PDEATHSIG (SIGKILL when their parent
    dies), and Linux delivers that when the parent *thread* exits. Started from the
    front door's engine thread, the whole Ray was killed the moment that thread ended (an
    engine stopped or restarted): the driver's `ray.shutdown()` then spent 15 s in
    timeouts against a dead GCS and the agents, orphaned, lingered for a minute. From the
    main thread (which lives as long as the process) `ray.init` runs in place."""

    def __init__(self) -> None:
        self._release = threading.Event()
        self._thread: threading.Thread | None = None

    def run(self, init: Callable[[], None]) -> None:
        if threading.current_thread() is threading.main_thread():
            init()
            return
        done: queue.Queue[BaseException | None] = queue.Queue(maxsize=1)

        def host() -> None:
            try:
                init()
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller
                done.put(exc)
                return
            done.put(None)
            self._release.wait()

        # A daemon: at interpreter exit it is not joined, and Ray's processes die with ours.
        self._thread = threading.Thread(target=host, name="kvloom-ray-host", daemon=True)
        self._thread.start()
        error = done.get()
        if error is not None:
            raise error

    def release(self) -> None:
        self._release.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class _Embedded:
    """The local Ray this process started: the processes it spawned (psutil handles, which
    know their start time, so a reused pid is never signalled) and its host thread."""

    def __init__(self, processes: list[Any], host: _HostThread) -> None:
        self.processes = processes
        self.host = host


_embedded: _Embedded | None = None
_connected_hooks: list[Callable[[], None]] = []
_lock = threading.Lock()  # one connect_ray at a time
_atexit_registered = False


def first_line(err: BaseException) -> str:
    """An error's first line without terminal colours (Ray colours its messages), or its
    type's name when it has no text."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip()
    return text.splitlines()[0].strip() if text else type(err).__name__


def actor_runtime_env() -> dict[str, Any] | None:
    """The runtime_env of every kvloom actor: this process's KVLOOM_* variables (the
    operator's settings reach workers on every node), or None when none is set."""
    from kvloom.contracts import envs

    env_vars = envs.set_here()
    return {"env_vars": env_vars} if env_vars else None


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def call_when_connected(hook: Callable[[], None]) -> Callable[[], None]:
    """Calls `hook()` (in the connecting thread) each time `connect_ray` has connected; returns
    a function that removes it. The front door uses it to take SIGTERM and SIGINT back at
    once from the handler Ray's core worker installs as it connects."""
    _connected_hooks.append(hook)

    def remove() -> None:
        with contextlib.suppress(ValueError):
            _connected_hooks.remove(hook)

    return remove


def _connected() -> None:
    for hook in list(_connected_hooks):
        try:
            hook()
        except Exception:
            logger.debug("a connect_ray hook failed", exc_info=True)


def connect_ray(num_cpus_for_local: int, **local_init_kwargs: Any) -> None:
    """Joins RAY_ADDRESS's cluster, or starts an embedded local Ray (see the module doc);
    `local_init_kwargs` go to the embedded Ray's `ray.init` (tests: `job_config`,
    `log_to_driver`). Raises RayStartError (one line) if neither works."""
    import ray

    with _lock:
        if not ray.is_initialized():
            _connect(ray, num_cpus_for_local, local_init_kwargs)
            _connected()


class _NotMainThreadNotice(logging.Filter):
    """Drops Ray's "SIGTERM handler is not set because current thread is not the main
    thread": kvloom handles SIGTERM itself (the front door drains)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("SIGTERM handler is not set")


def _connect(ray: Any, num_cpus_for_local: int, local_init_kwargs: dict[str, Any]) -> None:
    ray_worker_log = logging.getLogger("ray._private.worker")
    if not any(isinstance(f, _NotMainThreadNotice) for f in ray_worker_log.filters):
        ray_worker_log.addFilter(_NotMainThreadNotice())
    address = os.environ.get("RAY_ADDRESS")
    # gRPC's C core logs at INFO when Ray forks under a live channel; keep it quiet.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    if address:
        # A cluster on this machine's loopback (a `ray start --head --node-ip-address
        # 127.0.0.1` beside us, as the tests run): keep Ray from swapping 127.0.0.1 for the
        # host's network address, on which that cluster does not listen.
        joining = _single_machine_ray() if _loopback_host(address) else contextlib.nullcontext()
        try:
            with joining:
                ray.init(address=address, log_to_driver=True)
        except Exception as exc:
            logger.debug("ray.init(address=%r) failed", address, exc_info=True)
            raise RayStartError(
                f"cannot join the Ray cluster at RAY_ADDRESS={address}: {first_line(exc)}; "
                "check that it is up (`ray status`) or unset RAY_ADDRESS to start a local Ray"
            ) from None
    else:
        _start_local(num_cpus_for_local, local_init_kwargs)


def _loopback_host(address: str) -> bool:
    """Whether a Ray address ("host:port", "scheme://host:port") names a loopback host."""
    host = address.split("://", 1)[-1].rsplit("@", 1)[-1]
    host = host.rsplit(":", 1)[0] if host.count(":") == 1 or "]" in host else host
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _start_local(num_cpus: int, init_kwargs: dict[str, Any]) -> None:
    global _embedded, _atexit_registered
    import psutil  # Ray ships it (ray/thirdparty_files, on sys.path once ray is imported)
    import ray

    # Ray gives its GCS 30 s to bind a port; a busy small machine (CI's 2 cores under a
    # test run) was seen to need more. The variable stays the operator's to set.
    os.environ.setdefault(GCS_PORT_WAIT_VARIABLE, str(GCS_PORT_WAIT_S))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}

    def init() -> None:
        # address="local": a Ray of its own, even where another Ray runs on this host
        # (without it, ray.init joins that one and refuses num_cpus).
        options = dict(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
        if "RAY_worker_niceness" not in os.environ:
            options["_system_config"] = {"worker_niceness": 0}
        ray.init("local", **{**options, **init_kwargs}, _node_ip_address=LOOPBACK)

    for attempt in range(1, START_ATTEMPTS + 1):
        host = _HostThread()
        try:
            with _metrics_ports(), _single_machine_ray(), _agent_port_free():
                host.run(init)
            break
        except Exception as exc:
            logger.debug("ray.init() of the embedded local Ray failed", exc_info=True)
            started = [p for p in _children(me) if p.pid not in before]
            with contextlib.suppress(Exception):
                ray.shutdown()
            host.release()
            _stop_processes(started)
            if attempt < START_ATTEMPTS and _timed_out(exc):
                logger.warning(
                    "the local Ray did not come up in time; trying again (attempt %d of %d)",
                    attempt + 1,
                    START_ATTEMPTS,
                )
                time.sleep(RETRY_PAUSE_S)
                continue
            raise RayStartError(_local_start_advice(exc)) from None
    _embedded = _Embedded([p for p in _children(me) if p.pid not in before], host)
    if not _atexit_registered:  # whoever started it (LLM, a test) leaves nothing behind
        atexit.register(shutdown_ray)  # runs before Ray's own atexit ray.shutdown()
        _atexit_registered = True
    logger.debug(
        "embedded Ray on %s: %d processes",
        ray.util.get_node_ip_address(),
        len(_embedded.processes),
    )


def _children(process: Any) -> list[Any]:
    import psutil

    try:
        return process.children(recursive=True)
    except psutil.Error:
        return []


@contextlib.contextmanager
def _metrics_ports() -> Iterator[None]:
    """Free metrics ports for the processes `ray.init` spawns, unless the operator set the
    variables. They are set only while Ray starts: left in this process's environment,
    a child it starts later (a `kvloom serve` subprocess) would take them for the
    operator's and give its own Ray this Ray's ports, which are in use."""
    chosen = [name for name in _METRICS_PORT_VARIABLES if name not in os.environ]
    for name in chosen:
        os.environ[name] = str(free_loopback_port())
    try:
        yield
    finally:
        for name in chosen:
            os.environ.pop(name, None)


@contextlib.contextmanager
def _single_machine_ray() -> Iterator[None]:
    """Ray resolves a node address of 127.0.0.1 to the host's network address when it
    expects other machines to join (its `ENABLE_RAY_CLUSTER`, on by default on Linux). The
    embedded Ray is one machine's: turn that off while it starts, so every component binds
    and advertises 127.0.0.1. Once started, Ray reads the address from its node."""
    try:
        from ray._private import ray_constants
    except ImportError:  # a Ray without the switch: nothing to do
        yield
        return
    saved = getattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


@contextlib.contextmanager
def _agent_port_free() -> Iterator[None]:
    """`ray.init` has no argument for the dashboard agent's HTTP port, which defaults to the
    fixed 52365: a second Ray on the host then gets an agent without HTTP (its job
    submission fails). Port 0, which the agent supports, picks a free one."""
    try:
        from ray._private import parameter
    except ImportError:
        yield
        return
    original = parameter.RayParams
    if "dashboard_agent_listen_port" not in inspect.signature(original).parameters:
        yield
        return

    class RayParams(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("dashboard_agent_listen_port", 0)
            super().__init__(*args, **kwargs)

    parameter.RayParams = RayParams
    try:
        yield
    finally:
        parameter.RayParams = original


def _timed_out(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, TimeoutError) or any(
        word in text for word in ("timed out", "timeout", "deadline exceeded", "did not")
    )


def _local_start_advice(exc: BaseException) -> str:
    """One line: why the embedded Ray did not start, and what to try."""
    cause = first_line(exc)
    temp = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC or "No space left" in str(exc):
        return (
            f"could not start a local Ray: the disk holding {temp} is full ({cause}); "
            "free space there or set RAY_TMPDIR to another directory"
        )
    if _timed_out(exc):
        return (
            f"could not start a local Ray: it did not come up in time ({cause}); the machine "
            "may be busy: retry, raise RAY_gcs_server_port_wait_time_s, or start Ray yourself "
            "(`ray start --head`) and set RAY_ADDRESS"
        )
    return (
        f"could not start a local Ray: {cause}; check for another Ray on this host "
        f"(`ray status`) and free space in {temp}, or start Ray yourself (`ray start "
        "--head`) and set RAY_ADDRESS"
    )


def shutdown_ray() -> None:
    """Disconnects from Ray. An embedded Ray is stopped with every process it started (those
    still alive shortly after `ray.shutdown()` are terminated, then killed); a RAY_ADDRESS
    cluster keeps running."""
    global _embedded
    import sys

    ray = sys.modules.get("ray")
    embedded, _embedded = _embedded, None
    processes: list[Any] = []
    if embedded is not None:
        # Workers started since (actors) are the raylet's children: take the whole tree now.
        seen: dict[int, Any] = {}
        for process in embedded.processes:
            for p in [process, *_children(process)]:
                seen.setdefault(p.pid, p)
        processes = list(seen.values())
    if ray is not None and ray.is_initialized():
        begun = time.monotonic()
        try:
            ray.shutdown()
        except Exception:
            logger.debug("ray.shutdown() failed", exc_info=True)
        logger.debug("ray.shutdown() took %.1f s", time.monotonic() - begun)
    if embedded is not None:
        embedded.host.release()
    if processes:
        _stop_processes(processes)


def _stop_processes(processes: list[Any]) -> None:
    """Waits briefly for the processes to exit, then SIGTERM, then SIGKILL."""
    import psutil

    alive = [p for p in processes if _alive(p)]
    if alive:
        _, alive = psutil.wait_procs(alive, timeout=EXIT_GRACE_S)
    for signal_them, grace in (("terminate", TERMINATE_GRACE_S), ("kill", TERMINATE_GRACE_S)):
        alive = [p for p in alive if _alive(p)]
        if not alive:
            return
        logger.debug("ending %d leftover Ray processes (%s)", len(alive), signal_them)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                getattr(p, signal_them)()
        _, alive = psutil.wait_procs(alive, timeout=grace)
    for p in alive:
        if _alive(p):
            logger.warning("Ray process %d did not exit", p.pid)


def _alive(process: Any) -> bool:
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
