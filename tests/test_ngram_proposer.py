"""Speculative decoding: the prompt-lookup n-gram proposer (run on the workers) and the
acceptance statistics (control plane)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvloom.cluster.spec_decode.stats import SpecDecodeStats
from kvloom.workers.spec_decode.ngram_proposer import NgramProposer


def naive_proposal(tokens, k, max_n, min_n, extend_periodic):
    """Brute force of the documented rule, for cross-checking."""
    tokens = list(tokens)
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                text = list(tokens)
                out = []
                while len(out) < k:
                    source = start + n + len(out)
                    if source >= len(text):
                        break
                    out.append(text[source])
                    if extend_periodic:
                        text.append(out[-1])
                return out
    return []


def test_proposes_what_followed_the_last_ngram():
    proposer = NgramProposer(max_n=2)
    assert proposer.propose([1, 2, 3, 4, 1, 2], 2) == [3, 4]


def test_most_recent_occurrence_wins():
    proposer = NgramProposer(max_n=2)
    assert proposer.propose([1, 2, 9, 1, 2, 8, 1, 2], 2) == [8, 1]


def test_longer_ngram_is_preferred_over_a_more_recent_shorter_one():
    tokens = [5, 1, 2, 7, 3, 1, 2, 8, 5, 1, 2]
    assert NgramProposer(max_n=3).propose(tokens, 3) == [7, 3, 1]
    assert NgramProposer(max_n=2).propose(tokens, 3) == [8, 5, 1]


def test_min_n_bounds_the_search():
    assert NgramProposer(min_n=2, max_n=3).propose([1, 2, 3, 1], 3) == []
    assert NgramProposer(min_n=1, max_n=3).propose([1, 2, 3, 1], 3) == [2, 3, 1]
    assert NgramProposer(2, 3).propose([1, 2, 3, 1, 2], 3) == [3, 1, 2]  # (min_n, max_n)


def test_match_near_the_end_is_short_or_extended_periodically():
    tokens = [7, 8, 7, 8]
    assert NgramProposer(max_n=2, extend_periodic=False).propose(tokens, 5) == [7, 8]
    assert NgramProposer(max_n=2).propose(tokens, 5) == [7, 8, 7, 8, 7]
    assert NgramProposer(max_n=2).propose([4, 4, 4], 3) == [4, 4, 4]
    assert NgramProposer(max_n=2, extend_periodic=False).propose([4, 4, 4], 3) == [4]


def test_nothing_to_propose():
    proposer = NgramProposer()
    assert proposer.propose([], 4) == []
    assert proposer.propose([5], 4) == []
    assert proposer.propose([1, 2, 3, 4, 5], 4) == []


def test_num_tokens_sets_the_proposal_length():
    proposer = NgramProposer(max_n=1)
    assert proposer.propose([1, 2, 3, 4, 5, 1], 2) == [2, 3]
    assert proposer.propose([1, 2, 3, 4, 5, 1], 0) == []
    assert proposer.propose_batch([[1, 2, 1], [3, 3]], 2) == [[2, 1], [3, 3]]
    assert proposer.propose_batch([[1, 2, 1], [3, 3], [9]], [1, 4, 4]) == [
        [2],
        [3, 3, 3, 3],
        [],
    ]


def test_input_types_and_no_mutation():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 1, 4]
    copy = list(tokens)
    proposer = NgramProposer()
    result = proposer.propose(tokens, 3)
    assert result == [1, 5, 9]
    assert tokens == copy
    assert proposer.propose(tuple(tokens), 3) == result
    assert proposer.propose(np.array(tokens, dtype=np.int32), 3) == result
    assert all(type(t) is int for t in result)


def test_matches_brute_force_on_random_sequences():
    rng = random.Random(0)
    nonempty = 0
    for _ in range(600):
        alphabet = rng.choice([2, 3, 5, 50])
        tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 40))]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 8)
        periodic = rng.random() < 0.5
        got = NgramProposer(min_n, max_n, periodic).propose(tokens, k)
        assert got == naive_proposal(tokens, k, max_n, min_n, periodic), (tokens, k, max_n, min_n)
        nonempty += bool(got)
    assert 200 < nonempty < 600  # both outcomes were exercised


def test_long_sequence():
    rng = random.Random(1)
    tokens = [rng.randrange(30_000) for _ in range(50_000)]
    tokens += tokens[1000:1010]
    assert NgramProposer(max_n=4).propose(tokens, 4) == tokens[1010:1014]


def test_bad_configuration_names_the_field():
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(min_n=0, max_n=3)
    with pytest.raises(ValueError, match="max_n"):
        NgramProposer(min_n=2, max_n=1)
    with pytest.raises(ValueError, match="extend_periodic"):
        NgramProposer(extend_periodic="yes")
    with pytest.raises(ValueError, match="num_tokens"):
        NgramProposer().propose([1, 2], -1)
    with pytest.raises(ValueError, match="num_tokens"):
        NgramProposer().propose([1, 2], 1.5)
    with pytest.raises(ValueError, match="token_ids"):
        NgramProposer().propose([[1, 2], [3, 4]], 2)
    with pytest.raises(ValueError, match="num_tokens"):
        NgramProposer().propose_batch([[1], [2]], [1])


# ---------------------------------------------------------------- acceptance statistics


def test_stats_per_request_and_overall():
    stats = SpecDecodeStats()
    stats.record("a", 4, 4)
    stats.record("a", 4, 1)
    stats.record("a", 0, 0)  # nothing drafted: still a step that emitted one token
    stats.record("b", 2, 0)
    summary = stats.summary()
    a = summary["requests"]["a"]
    assert (a["num_steps"], a["num_drafted"], a["num_accepted"]) == (3, 8, 5)
    assert a["acceptance_rate"] == pytest.approx(5 / 8)
    assert a["mean_accepted_per_step"] == pytest.approx(5 / 3)
    assert a["mean_tokens_per_step"] == pytest.approx(8 / 3)
    assert a["acceptance_by_position"] == [1.0, 0.5, 0.5, 0.5]
    overall = summary["overall"]
    assert (overall["num_steps"], overall["num_drafted"], overall["num_accepted"]) == (4, 10, 5)
    assert overall["acceptance_rate"] == pytest.approx(0.5)
    assert overall["mean_tokens_per_step"] == pytest.approx(9 / 4)
    assert overall["acceptance_by_position"] == pytest.approx([2 / 3, 1 / 3, 0.5, 0.5])
    assert summary["requests"]["b"]["acceptance_rate"] == 0.0


def test_stats_empty_and_pop():
    stats = SpecDecodeStats()
    empty = stats.summary()["overall"]
    assert empty["acceptance_rate"] is None and empty["mean_tokens_per_step"] is None
    stats.record("a", 0, 0)
    assert stats.summary()["requests"]["a"]["acceptance_rate"] is None
    stats.record("b", 3, 2)
    popped = stats.pop("b")
    assert popped.num_accepted == 2
    assert "b" not in stats.summary()["requests"]
    assert stats.summary()["overall"]["num_accepted"] == 2  # overall keeps finished requests
    assert stats.pop("missing") is None


def test_stats_bad_input_names_the_field():
    stats = SpecDecodeStats()
    with pytest.raises(ValueError, match="num_accepted"):
        stats.record("a", 2, 3)
    with pytest.raises(ValueError, match="num_drafted"):
        stats.record("a", -1, 0)
    with pytest.raises(ValueError, match="request_id"):
        stats.record(7, 1, 1)
    assert stats.summary()["overall"]["num_steps"] == 0
