"""The replica router (cluster/routing.py): prefix routing by the engine's block-hash
chain, the least-loaded fallback, tenants kept apart, failed replicas skipped."""

from __future__ import annotations

import pytest

from kvloom.cluster.routing import MAX_EXTRA_LOAD, Router

BLOCK = 4


def prompt(seed: int, length: int = 16) -> list[int]:
    return [(seed * 31 + i * 7) % 500 for i in range(length)]


def test_a_conversations_next_turn_goes_where_its_prefix_went():
    router = Router(3, "prefix", BLOCK)
    first = [router.choose(prompt(s)) for s in range(3)]
    assert sorted(first) == [0, 1, 2]  # nothing cached anywhere yet: the least loaded
    for s in range(3):
        router.finished(first[s])
    for s in range(3):  # the next turn: the whole previous prompt plus new text
        assert router.choose(prompt(s) + [9, 8, 7, 6, 5]) == first[s]
    assert [r["routed_by_prefix"] for r in router.describe()] == [1, 1, 1]


def test_a_shorter_shared_prefix_still_wins_over_nothing():
    router = Router(2, "prefix", BLOCK)
    system = prompt(1, 12)
    home = router.choose(system + [1, 2, 3, 4])
    router.finished(home)
    assert router.choose(system + [50, 60, 70, 80]) == home  # three shared blocks


def test_an_overloaded_holder_loses_to_the_least_loaded():
    router = Router(2, "prefix", BLOCK)
    home = router.choose(prompt(0))
    for _ in range(MAX_EXTRA_LOAD):  # unrelated requests pile onto the holder
        router.replicas[home].in_flight += 1
    assert router.choose(prompt(0) + [1, 2, 3, 4]) == 1 - home


def test_cache_salt_keeps_tenants_apart():
    router = Router(2, "prefix", BLOCK)
    home = router.choose(prompt(0), cache_salt="tenant-a")
    router.finished(home)
    router.replicas[home].in_flight = 1  # so a miss goes to the other one
    assert router.choose(prompt(0), cache_salt="tenant-b") == 1 - home
    assert router.choose(prompt(0), cache_salt="tenant-a") == home


def test_a_failed_replica_gets_nothing_and_rejoins_empty():
    router = Router(2, "prefix", BLOCK)
    home = router.choose(prompt(0))
    router.set_up(home, False)
    assert router.choose(prompt(0)) == 1 - home
    router.set_up(1 - home, False)
    assert router.choose(prompt(0)) is None
    router.set_up(home, True)
    assert router.replicas[home].matched_blocks([b"x"]) == 0  # its table was cleared
    assert router.choose(prompt(0)) == home


def test_round_robin_and_least_loaded():
    rr = Router(3, "round-robin", BLOCK)
    assert [rr.choose(prompt(0)) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    least = Router(3, "least-loaded", BLOCK)
    least.replicas[0].in_flight = 5
    assert least.choose(prompt(0)) in (1, 2)


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="routing must be one of"):
        Router(2, "random", BLOCK)
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        Router(0)
