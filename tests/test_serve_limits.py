"""`kvloom serve`'s input-limit flags (cluster/commands/serve.py): each reaches the server's
FrontendLimits, a bad value exits 2 naming the flag, and a lowered limit is enforced over
gRPC as INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from kvloom.client import Client, ServerError, collect
from kvloom.cluster import cli
from kvloom.cluster.commands.serve import LIMIT_FLAGS, server_options
from kvloom.cluster.frontend import BackgroundServer, engine_factory
from kvloom.cluster.frontend.limits import FrontendLimits


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("llama"))


def serve_args(model_dir, *flags):
    return cli.build_parser().parse_args(["serve", "--model", model_dir, "--port", "0", *flags])


def test_every_limit_has_a_flag_that_reaches_the_server_options(model_dir):
    fields = {f.name for f in dataclasses.fields(FrontendLimits)}
    assert {name for name, _, _ in LIMIT_FLAGS.values()} == fields
    assert server_options(serve_args(model_dir)).limits == FrontendLimits()  # defaults kept
    flags, expected = [], {}
    for i, (flag, (name, kind, _)) in enumerate(LIMIT_FLAGS.items()):
        value = kind(7 + i)
        flags += [flag, str(value)]
        expected[name] = value
    assert server_options(serve_args(model_dir, *flags)).limits == FrontendLimits(**expected)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--max-prompt-bytes", "0", "--max-prompt-bytes must be an integer > 0, got 0"),
        ("--max-messages", "-3", "--max-messages must be an integer > 0, got -3"),
        ("--max-json-depth", "0", "--max-json-depth must be an integer > 0"),
        ("--render-timeout", "inf", "--render-timeout must be a finite number of seconds > 0"),
        ("--render-timeout", "nan", "--render-timeout must be a finite number of seconds > 0"),
        ("--render-timeout", "0", "--render-timeout must be a finite number of seconds > 0"),
    ],
)
def test_a_bad_limit_exits_2_naming_the_flag(model_dir, capsys, flag, value, message):
    assert cli.main(["serve", "--model", model_dir, flag, value]) == 2
    err = capsys.readouterr().err
    assert f"kvloom serve: error: {message}" in err, err
    assert "limits." not in err  # the flag, not the field


def test_a_limit_that_is_not_a_number_is_refused_by_the_parser(model_dir, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "--model", model_dir, "--max-stop-strings", "many"])
    assert exited.value.code == 2
    assert "argument --max-stop-strings: invalid int value: 'many'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def client(model_dir):
    args = serve_args(
        model_dir, "--max-prompt-bytes", "100", "--max-stop-strings", "1", "--max-messages", "2"
    )
    options = server_options(args)
    factory = engine_factory(model=model_dir, progress=False, dtype="float32", num_kv_blocks=64)
    with BackgroundServer(factory, options) as server, Client(server.address, timeout=30) as c:
        yield c


def refused(call) -> ServerError:
    with pytest.raises(ServerError) as raised:
        call()
    return raised.value


def test_lowered_limits_are_enforced_over_grpc(client):
    error = refused(lambda: collect(client.generate("x" * 101, max_tokens=2)))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details.startswith("text: too large: over 100 bytes"), error.details
    error = refused(lambda: collect(client.generate("hi", max_tokens=2, stop=["a", "b"])))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details.startswith("sampling.stop: at most 1"), error.details
    messages = [{"role": "user", "content": "hi"}] * 3
    error = refused(lambda: collect(client.chat(messages, max_tokens=2)))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details.startswith("messages: at most 2"), error.details
    # Within the limits, the same server answers.
    result = collect(client.generate("x" * 100, max_tokens=2, stop=["a"]))
    assert result.finish_reason in ("length", "stop")
