"""`--data-parallel-size` through the front door: a gRPC server over three replicas on
local Ray serves the tokens one in-process engine gives; GetServerInfo and /metrics report
each replica."""

from __future__ import annotations

import urllib.request

import pytest

from kvloom import Engine
from kvloom.client import Client, collect
from kvloom.cluster.frontend import engine_factory
from kvloom.cluster.frontend.background import BackgroundServer
from kvloom.cluster.frontend.options import ServerOptions
from tests.engine_helpers import PROMPTS, greedy, run_to_completion

pytestmark = pytest.mark.slow


def test_three_replicas_behind_one_grpc_door(local_ray, tiny_model):
    model_dir = str(tiny_model("llama"))
    settings = dict(model=model_dir, dtype="float32", block_size=4, max_num_seqs=8)
    expected = run_to_completion(Engine(progress=False, **settings), PROMPTS, greedy(6))
    factory = engine_factory(
        progress=False, executor="ray", data_parallel_size=3, routing="round-robin", **settings
    )
    options = ServerOptions(model=model_dir, port=0, metrics_port=0, warmup=False)
    server = BackgroundServer(factory, options).start()
    try:
        with Client(server.address, timeout=60) as client:
            for prompt, want in zip(PROMPTS, expected):
                got = collect(
                    client.generate(prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
                )
                assert got.token_ids == want.outputs[0].token_ids
            info = client.server_info()
            assert info.routing == "round-robin"
            assert [(r.index, r.up, r.num_routed) for r in info.replicas] == [
                (0, True, 3),
                (1, True, 3),
                (2, True, 2),
            ]
            assert all(r.num_running_requests == 0 for r in info.replicas)
        stats = server.stats()
        assert stats["data_parallel_size"] == 3 and stats["num_replicas_up"] == 3
        assert [r["routed"] for r in stats["replicas"]] == [3, 3, 2]
        url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read().decode()
        assert 'kvloom_replica_routed_total{replica="2"} 2' in body
        assert 'kvloom_replica_up{replica="0"} 1' in body
    finally:
        server.stop()
