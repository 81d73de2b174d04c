"""The Ray executor on a GPU: one CUDA worker actor, async scheduling on by default and
CUDA graphs captured, gives the tokens of the in-process engine on the same GPU (the same
kernels and graphs run in another process), and `kvloom serve`'s path (scheduler actor,
channels) streams them."""

from __future__ import annotations

import pytest
from engine_helpers import PROMPTS, assert_pool_full, greedy, run_to_completion

from kvloom import Engine

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def release_cached_gpu_memory():
    """The worker actors are other processes: memory this process's caching allocator kept
    from earlier tests (engines sized by a profiling run) must go back to the driver first."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()


SETTINGS = dict(dtype="bfloat16", device="cuda", progress=False, num_kv_blocks=512)


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_ray_worker_on_cuda_matches_in_process(local_ray, tiny_model, hybrid_model, arch):
    path = str(tiny_model(arch) if arch == "llama" else hybrid_model(arch))
    local = Engine(model=path, executor="inprocess", **SETTINGS)
    expected = [o.outputs[0].token_ids for o in run_to_completion(local, PROMPTS, greedy(12))]
    local.shutdown()
    remote = Engine(model=path, executor="ray", **SETTINGS)
    try:
        assert remote.async_scheduling, "async scheduling is the default on CUDA workers"
        outs = run_to_completion(remote, PROMPTS, greedy(12))
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert_pool_full(remote)
    finally:
        remote.shutdown()


def test_scheduler_actor_on_cuda_streams_the_same_tokens(local_ray, tiny_model):
    from kvloom.cluster.scheduler_actor import RemoteEngine

    path = str(tiny_model("llama"))
    local = Engine(model=path, executor="inprocess", **SETTINGS)
    expected = [o.outputs[0].token_ids for o in run_to_completion(local, PROMPTS, greedy(12))]
    local.shutdown()
    remote = RemoteEngine(dict(model=path, executor="ray", **SETTINGS))
    try:
        outs = run_to_completion(remote, PROMPTS, greedy(12))
        assert [o.outputs[0].token_ids for o in outs] == expected
    finally:
        remote.shutdown()
