"""Data-parallel replicas behind one engine interface (cluster/replicas.py) on local Ray:
the same tokens as one replica, prefix-aware routing keeps a conversation's hits, and a
replica whose worker dies fails only its own requests, leaves routing, and comes back."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvloom import Engine, SamplingParams
from kvloom.cluster.engine_channel import RequestError
from kvloom.cluster.replicas import ReplicaSet
from tests.engine_helpers import greedy, run_to_completion

pytestmark = pytest.mark.slow

SETTINGS = dict(dtype="float64", progress=False, block_size=4, max_num_seqs=32)


@pytest.fixture(scope="module")
def dense_path(tiny_model):
    return tiny_model("qwen2")


def replica_set(path, n: int, routing: str = "prefix") -> ReplicaSet:
    return ReplicaSet(dict(SETTINGS, model=str(path), executor="ray"), n, routing=routing)


def mixed_prompts(n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [[5 + (i * 37 + j * 11) % 500 for j in range(3 + i % 29)] for i in range(n)]
    params = [
        SamplingParams(max_tokens=4 + i % 9, temperature=0.0, ignore_eos=True)
        if i % 3
        else SamplingParams(max_tokens=6, temperature=0.8, seed=i, ignore_eos=True)
        for i in range(n)
    ]
    return prompts, params


def assert_every_pool_full(replicas: ReplicaSet) -> None:
    for entry in replicas.stats()["replicas"]:
        assert entry["num_free_blocks"] == entry["num_blocks"], entry


def conversations(engine, num_conversations: int = 24, num_turns: int = 4, seed: int = 0):
    """As engine_helpers.multi_turn, but each turn's requests arrive in a new order (as
    real clients' do), so no fixed arrival pattern maps a conversation to one replica."""
    import random

    rng = random.Random(seed)
    prompts = [
        [5 + rng.randrange(400) for _ in range(rng.randint(9, 20))]
        for _ in range(num_conversations)
    ]
    turns = []
    for _ in range(num_turns):
        order = list(range(num_conversations))
        rng.shuffle(order)
        outs = run_to_completion(engine, [prompts[i] for i in order], greedy(6))
        by_conversation = dict(zip(order, outs))
        turns.append([(prompts[i], by_conversation[i]) for i in range(num_conversations)])
        prompts = [
            p
            + by_conversation[i].outputs[0].token_ids
            + [5 + rng.randrange(400) for _ in range(rng.randint(3, 9))]
            for i, p in enumerate(prompts)
        ]
    return turns


def hit_rate(turns) -> float:
    """Cached tokens of turns >= 2 over their prompt tokens."""
    later = [out for turn in turns[1:] for _, out in turn]
    return sum(o.num_cached_tokens for o in later) / sum(len(o.prompt_token_ids) for o in later)


def test_three_replicas_give_one_replicas_tokens_and_keep_prefix_hits(local_ray, dense_path):
    prompts, params = mixed_prompts(300)
    single = Engine(model=str(dense_path), **SETTINGS)
    expected = [o.outputs[0].token_ids for o in run_to_completion(single, prompts, params)]
    single_rate = hit_rate(conversations(single))

    rates = {}
    for routing in ("prefix", "round-robin"):
        replicas = replica_set(dense_path, 3, routing)
        try:
            if routing == "prefix":
                outs = run_to_completion(replicas, prompts, params)
                assert [o.outputs[0].token_ids for o in outs] == expected
                routed = [r["routed"] for r in replicas.router.describe()]
                assert min(routed) > 0, routed  # every replica served some
            rates[routing] = hit_rate(conversations(replicas))
            assert_every_pool_full(replicas)
        finally:
            replicas.shutdown()
    print(f"hit rate: one replica {single_rate:.3f}, 3 replicas {rates}")
    assert rates["prefix"] >= 0.95 * single_rate, (single_rate, rates)
    assert rates["round-robin"] < 0.8 * single_rate, (single_rate, rates)  # the baseline


def worker_pids(replica) -> list[int]:
    """The process ids of a replica's worker actors (asked through its scheduler actor)."""
    import ray

    def pids(actor_self):
        refs = [
            a.__ray_call__.remote(lambda _: os.getpid()) for a in actor_self.engine.executor.actors
        ]
        return ray.get(refs)

    return ray.get(replica.actor.__ray_call__.remote(pids))


def test_a_dead_replica_fails_only_its_requests_and_rejoins(local_ray, dense_path):
    replicas = replica_set(dense_path, 3, routing="round-robin")
    try:
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        prompts = [[5 + (i * 13 + j) % 500 for j in range(8)] for i in range(90)]
        expected = run_to_completion(
            Engine(model=str(dense_path), **SETTINGS), prompts, greedy(400)
        )
        ids = [replicas.next_request_id() for _ in prompts]
        for rid, prompt in zip(ids, prompts):
            replicas.add_request(rid, {"prompt_token_ids": prompt}, params)
        served_by = dict(replicas._where)
        for _ in range(3):
            replicas.step()
        victim = 1
        os.kill(worker_pids(replicas.replicas[victim])[0], signal.SIGKILL)
        killed_at = time.monotonic()
        done, failed_at = {}, {}
        probe = None  # a request added while the victim is down: it must go elsewhere
        while replicas.has_unfinished_requests():
            for out in replicas.step():
                done[out.request_id] = out
                if isinstance(out, RequestError):
                    failed_at[out.request_id] = time.monotonic() - killed_at
            if failed_at and probe is None and not replicas.router.replicas[victim].up:
                probe = replicas.next_request_id()
                replicas.add_request(probe, {"prompt_token_ids": prompts[0]}, greedy(6))
                assert replicas._where[probe] != victim
        assert probe is not None, "the failed replica was never seen out of routing"
        failed = {rid for rid, out in done.items() if isinstance(out, RequestError)}
        assert failed == {rid for rid, i in served_by.items() if i == victim}
        assert all(done[rid].replica_lost for rid in failed)
        assert "model replica 1 failed" in done[next(iter(failed))].message
        assert max(failed_at.values()) < 10
        for rid, prompt_index in zip(ids, range(len(prompts))):
            if rid not in failed:
                assert done[rid].outputs[0].token_ids == expected[prompt_index].outputs[0].token_ids
        assert done[probe].outputs[0].token_ids == expected[0].outputs[0].token_ids[:6]

        # It restarts, rejoins routing and serves a correct request.
        deadline = time.monotonic() + 120
        while not replicas.router.replicas[victim].up and time.monotonic() < deadline:
            time.sleep(0.5)
            replicas.step()
        assert replicas.router.replicas[victim].up, "the replica did not come back"
        routed_before = replicas.router.replicas[victim].routed
        routed = pin_next_request(replicas, victim)
        out = run_to_completion(replicas, [prompts[0]], greedy(6))[0]
        assert routed() == routed_before + 1  # served by the restarted replica
        assert out.outputs[0].token_ids == expected[0].outputs[0].token_ids[:6]
        assert replicas.stats()["num_replica_failures"] == 1
        assert_every_pool_full(replicas)
    finally:
        replicas.shutdown()


def pin_next_request(replicas: ReplicaSet, index: int):
    """Makes the next request go to replica `index` (the others look busy); returns a
    reader of that replica's routed count."""
    for i, state in enumerate(replicas.router.replicas):
        if i != index:
            state.in_flight += 1000
    replicas.router.policy = "least-loaded"
    return lambda: replicas.router.replicas[index].routed
