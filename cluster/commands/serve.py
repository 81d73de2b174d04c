"""`kvloom serve --model DIR`: the gRPC server (kvloom.v1.Generation, health, reflection),
and with --http-port the OpenAI-compatible HTTP API beside it.

SIGTERM or Ctrl-C drains (readiness NOT_SERVING, in-flight requests finish for up to
--drain-timeout seconds; the drain is announced on stdout); a second signal stops at once.
Then every process the server started stops, an embedded local Ray included.

Exit status: 0 after a signal; 2 for bad settings; 1 when start-up fails (model directory,
weights, port in use, Ray) or the engine failed for good. The cause is one line on stderr,
`kvloom serve: error: ...` (the traceback is logged at DEBUG).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over gRPC (and the OpenAI HTTP API with --http-port)",
        description="Serve a Hugging Face checkpoint directory over gRPC (kvloom.v1.Generation).",
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--model",
        required=True,
        help="Hugging Face checkpoint directory, or a Hub repo id (org/name) fetched into the "
        "Hugging Face cache (HF_HUB_OFFLINE=1: the cache only)",
    )
    engine.add_argument(
        "--revision", default=None, help="Hub revision (branch, tag or commit) of a repo id"
    )
    engine.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
    engine.add_argument("--dcp", type=int, default=1, help="decode context parallel size")
    engine.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="model replicas behind this front door, each with its own TP × DCP grid "
        "(Ray executor; default 1; docs/ray.md)",
    )
    engine.add_argument(
        "--routing",
        default="prefix",
        choices=("prefix", "least-loaded", "round-robin"),
        help="how requests pick a replica: prefix (default: the replica that holds the "
        "prompt's longest cached prefix, else the least loaded), least-loaded, round-robin",
    )
    engine.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16, ...")
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per KV block (default 16; hybrid models: sized to their state pages)",
    )
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--max-num-seqs", type=int, default=64)
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--num-kv-blocks", type=int, default=None, help="fix the KV pool size")
    engine.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "fp8", "fp8_e4m3"),
        help="attention KV pages: auto (the model dtype) or fp8 (float8_e4m3fn with the "
        "checkpoint's k/v scales, else 1.0: about twice the tokens in the same memory)",
    )
    engine.add_argument("--no-prefix-caching", action="store_true")
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    engine.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    engine.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant kernels: a request's tokens do not depend on what else is "
        "batched, chunking, prefix hits or preemption (docs/configuration.md)",
    )
    engine.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="one step at a time (async scheduling is on by default for one in-process CUDA rank)",
    )
    engine.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help="speculative decoding, as a JSON object with vLLM's keys, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 3}\' or '
        '\'{"method": "draft_model", "model": DIR, "num_speculative_tokens": 3}\'; '
        '"placement": "remote" runs the drafter in its own Ray actor (docs/speculative.md)',
    )
    engine.add_argument(
        "--executor",
        default="ray",
        choices=("ray", "inprocess"),
        help="ray (default): the scheduler and workers run as Ray actors (RAY_ADDRESS's "
        "cluster, or an embedded local Ray); inprocess: one rank in this process",
    )

    server = parser.add_argument_group("server")
    server.add_argument(
        "--host",
        default=os.environ.get("KVLOOM_HOST") or "127.0.0.1",
        help="address to listen on (default: $KVLOOM_HOST, else 127.0.0.1, this machine "
        "only; 0.0.0.0: every interface, as a container needs; the image sets KVLOOM_HOST)",
    )
    server.add_argument("--port", type=int, default=50051)
    server.add_argument("--tls-cert", help="PEM certificate chain (with --tls-key)")
    server.add_argument("--tls-key", help="PEM private key (with --tls-cert)")
    server.add_argument("--auth-token-file", help="require `authorization: Bearer <token>`")
    server.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics")
    server.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health, /metrics) on this port of --host (default: off; docs/http.md)",
    )
    server.add_argument(
        "--served-model-name", default=None, help="the model's id over HTTP (default: --model)"
    )
    server.add_argument(
        "--tool-call-parser",
        default="auto",
        help="hermes, qwen3_coder, kimi_k2, llama3_json, mistral, deepseek_v3; "
        "auto: by model type; none: off",
    )
    server.add_argument(
        "--reasoning-parser", default="auto", help="think, kimi; auto: by model type; none: off"
    )
    server.add_argument(
        "--max-queue",
        type=int,
        default=1024,
        help="requests that may wait beyond --max-num-seqs; more get RESOURCE_EXHAUSTED",
    )
    server.add_argument("--max-message-mb", type=int, default=64, help="gRPC message size limit")
    server.add_argument("--keepalive-time", type=float, default=60.0, help="seconds")
    server.add_argument("--keepalive-timeout", type=float, default=20.0, help="seconds")
    server.add_argument("--drain-timeout", type=float, default=30.0, help="seconds")
    server.add_argument(
        "--on-worker-failure",
        default="restart",
        choices=("restart", "exit"),
        help="when a worker or the scheduler dies: restart the replica and serve again "
        "(default), or exit with status 1 so a supervisor restarts the process",
    )
    server.add_argument("--no-warmup", action="store_true", help="report ready without warm-up")
    server.add_argument("--log-level", default="INFO")
    add_limit_flags(parser)
    parser.set_defaults(func=run)


# --flag -> (FrontendLimits field, type, what it bounds). docs/grpc.md, "Limits".
LIMIT_FLAGS = {
    "--max-prompt-bytes": (
        "max_prompt_bytes",
        int,
        "UTF-8 bytes of a text prompt, and of a chat's text in all "
        "(default: 32 per position of max_model_len, at least 64 KiB)",
    ),
    "--max-messages": ("max_messages", int, "messages in a chat"),
    "--max-tools": ("max_tools", int, "tools in a chat"),
    "--max-tool-schema-bytes": ("max_tool_schema_bytes", int, "bytes of one tool's parameters"),
    "--max-template-kwargs-bytes": (
        "max_template_kwargs_bytes",
        int,
        "bytes of chat_template_kwargs",
    ),
    "--max-json-depth": (
        "max_json_depth",
        int,
        "JSON nesting of tool parameters, tool-call arguments, chat_template_kwargs",
    ),
    "--max-stop-strings": ("max_stop_strings", int, "stop strings of a request"),
    "--max-stop-string-bytes": ("max_stop_string_bytes", int, "bytes of one stop string"),
    "--max-stop-token-ids": ("max_stop_token_ids", int, "stop_token_ids of a request"),
    "--max-detokenize-ids": ("max_detokenize_ids", int, "token ids of one Detokenize call"),
    "--max-abort-ids": ("max_abort_ids", int, "request ids of one Abort call"),
    "--render-timeout": (
        "render_timeout_s",
        float,
        "seconds one tokenization or chat-template rendering may take (then DEADLINE_EXCEEDED)",
    ),
}


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    from kvloom.cluster.frontend.limits import FrontendLimits

    defaults = FrontendLimits()
    group = parser.add_argument_group("input limits (over one: INVALID_ARGUMENT naming the field)")
    for flag, (name, kind, what) in LIMIT_FLAGS.items():
        default = getattr(defaults, name)
        shown = "" if default is None else f" (default {default})"
        metavar = "SECONDS" if kind is float else "N"
        group.add_argument(
            flag, type=kind, default=None, dest=name, metavar=metavar, help=what + shown
        )


def limits_from_flags(args: argparse.Namespace):
    """The FrontendLimits the flags ask for (defaults for those not given)."""
    from kvloom.cluster.frontend.limits import FrontendLimits

    given = {name: getattr(args, name) for name, _, _ in LIMIT_FLAGS.values()}
    return FrontendLimits(**{name: value for name, value in given.items() if value is not None})


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=args.model,
        tensor_parallel_size=args.tp,
        decode_context_parallel_size=args.dcp,
        dtype=args.dtype,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed,
        device=args.device,
        executor=args.executor,
        enforce_eager=args.enforce_eager,
    )
    if args.deterministic:
        kwargs["deterministic"] = True
    if args.no_async_scheduling:
        kwargs["async_scheduling"] = False
    if args.speculative_config is not None:
        kwargs["speculative_config"] = parse_speculative_config(args.speculative_config)
    if args.data_parallel_size != 1:
        kwargs.update(
            data_parallel_size=args.data_parallel_size,
            routing=args.routing,
            restart_replicas=args.on_worker_failure == "restart",
        )
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    if args.num_kv_blocks is not None:
        kwargs["num_kv_blocks"] = args.num_kv_blocks
    if args.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    return kwargs


def parse_speculative_config(text: str) -> dict[str, Any]:
    """--speculative-config's JSON object (its keys are checked with the engine's)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(
            f"--speculative-config must be a JSON object, got {type(value).__name__} {text!r}"
        )
    return value


# Engine fields whose flag has another name: errors name the flag the user typed.
FLAG_OF_FIELD = {
    "tensor_parallel_size": "--tp",
    "decode_context_parallel_size": "--dcp",
    "enable_prefix_caching": "--no-prefix-caching",
    # server options (ServerOptions fields)
    "max_waiting": "--max-queue",
    "drain_timeout_s": "--drain-timeout",
    "keepalive_time_s": "--keepalive-time",
    "keepalive_timeout_s": "--keepalive-timeout",
    # input limits (FrontendLimits fields, named `limits.<field>` in their errors)
    **{name: flag for flag, (name, _, _) in LIMIT_FLAGS.items()},
}


def flag_names(message: str) -> str:
    """An engine setting's error as a `kvloom serve` user reads it: `--tp must be ...`,
    `--max-num-seqs must be ...` (the field at the start of the message becomes its flag)."""
    field, sep, rest = message.partition(" ")
    name = field.rstrip(":")
    spec, dot, key = name.partition(".")
    if spec == "speculative_config":  # a key of the flag's JSON object
        return f"--speculative-config: {key + ' ' if dot else ''}{rest}"
    if spec == "limits" and dot:  # a FrontendLimits field
        field, name = field[len("limits.") :], key
    if not sep or not name.isidentifier():
        return message
    flag = FLAG_OF_FIELD.get(name) or "--" + name.replace("_", "-")
    return f"{flag}{field[len(name) :]} {rest}"


def server_options(args: argparse.Namespace):
    from kvloom.cluster.frontend.options import ServerOptions, read_token_file

    return ServerOptions(
        model=args.model,
        host=args.host,
        port=args.port,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        auth_token=read_token_file(args.auth_token_file) if args.auth_token_file else None,
        max_message_bytes=args.max_message_mb * 1024 * 1024,
        keepalive_time_s=args.keepalive_time,
        keepalive_timeout_s=args.keepalive_timeout,
        max_waiting=args.max_queue,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        drain_timeout_s=args.drain_timeout,
        on_worker_failure=args.on_worker_failure,
        metrics_port=args.metrics_port,
        http_port=args.http_port,
        served_model_name=args.served_model_name,
        warmup=not args.no_warmup,
        limits=limits_from_flags(args),
    )


def startup_cause(exc: BaseException) -> str:
    """One line saying why start-up failed, free of Ray internals: a Ray task's error is
    reported as the exception it wraps."""
    from kvloom.cluster.ray_local import first_line

    ray = sys.modules.get("ray")
    task_error = getattr(getattr(ray, "exceptions", None), "RayTaskError", None)
    for _ in range(8):
        cause = getattr(exc, "cause", None) if task_error and isinstance(exc, task_error) else None
        if not isinstance(cause, BaseException) or cause is exc:
            break
        exc = cause
    text = first_line(exc) if str(exc).strip() else ""
    if isinstance(exc, ValueError | OSError | RuntimeError) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _fail(message: str, code: int) -> int:
    print(f"kvloom serve: error: {message}", file=sys.stderr, flush=True)
    return code


def run(args: argparse.Namespace) -> int:
    import asyncio

    from kvloom.cluster.frontend import engine_factory, serve_until_signal
    from kvloom.cluster.frontend.engine_builder import REPLICA_KWARGS
    from kvloom.contracts.config import EngineConfig
    from kvloom.contracts.model_source import resolve_model

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        # A repo id becomes its local snapshot once, here (downloading with a progress bar),
        # so the engine and the front door read the same directory; HTTP keeps the id.
        source = args.model
        args.model = resolve_model(args.model, args.revision)
        if args.served_model_name is None and args.model != source:
            args.served_model_name = source
        kwargs = engine_kwargs(args)
        if args.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {args.data_parallel_size}")
        if args.data_parallel_size > 1 and args.executor == "inprocess":
            raise ValueError("data_parallel_size > 1 needs --executor ray")
        # Bad settings fail here, before binding a port.
        EngineConfig.from_kwargs(**{k: v for k, v in kwargs.items() if k not in REPLICA_KWARGS})
    except ValueError as exc:
        return _fail(flag_names(str(exc)), 2)
    try:
        options = server_options(args)
    except ValueError as exc:
        return _fail(flag_names(str(exc)), 2)

    def on_ready(server) -> None:
        scheme = "grpcs" if options.tls_cert else "grpc"
        print(
            f"kvloom: serving {options.model} at {scheme}://{options.host}:{server.port}",
            flush=True,
        )
        if server.http_port is not None:
            web = "https" if options.tls_cert else "http"
            print(
                f"kvloom: OpenAI-compatible API at {web}://{options.host}:{server.http_port}/v1",
                flush=True,
            )
        if server.metrics_port is not None:
            print(
                f"kvloom: metrics at http://{options.host}:{server.metrics_port}/metrics",
                flush=True,
            )
        print(f"kvloom: {server.summary}", flush=True)

    def on_signal(sig: signal.Signals, count: int) -> None:
        name = signal.Signals(sig).name
        if count == 1:
            print(
                f"kvloom: {name}: draining; requests in flight may finish for up to "
                f"{options.drain_timeout_s:g} s (a second signal stops at once)",
                flush=True,
            )
        else:
            print(f"kvloom: {name} again: stopping now", flush=True)

    code = 0
    try:
        server = asyncio.run(
            serve_until_signal(
                engine_factory(**kwargs), options, on_ready=on_ready, on_signal=on_signal
            )
        )
        failure = getattr(server, "failure", None)
        if failure:
            code = _fail(str(failure), 1)
    except KeyboardInterrupt:  # SIGINT before the server took the signals (or after)
        code = 130
    except ValueError as exc:  # a setting the engine refused once it saw the model
        logger.debug("kvloom serve failed", exc_info=True)
        code = _fail(startup_cause(exc), 2)
    except Exception as exc:
        logger.debug("kvloom serve failed", exc_info=True)
        code = _fail(startup_cause(exc), 1)
    finally:
        _stop_ray()
    if code == 0:
        print("kvloom: stopped", flush=True)
    return code


def _stop_ray() -> None:
    """Stops the embedded local Ray (and every process of it) if this process started one;
    a RAY_ADDRESS cluster is only disconnected from. This takes a few seconds at most, and
    signals wait for it: a SIGTERM or Ctrl-C now would leave Ray's agents orphaned (and a
    KeyboardInterrupt would go to Ray's excepthook, which reports it to the GCS going away)."""
    if "ray" not in sys.modules:
        return
    import threading

    from kvloom.cluster.ray_local import shutdown_ray

    saved = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            saved[sig] = signal.getsignal(sig)
            signal.signal(sig, signal.SIG_IGN)
    try:
        shutdown_ray()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
