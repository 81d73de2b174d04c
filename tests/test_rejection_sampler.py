"""Rejection sampler for speculative decoding: greedy and sampled verification, padded lanes,
NaN in real lanes, bounded gathers, and distribution preservation (chi-square)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvloom.contracts.sampling_params import SamplingParams
from kvloom.workers.sampler import RowSamplingState, filter_probs, sample
from kvloom.workers.spec_decode.rejection_sampler import (
    PADDING_TOKEN_ID,
    _race,
    rejection_sample,
)

NAN = float("nan")
INF = float("inf")
GREEDY = SamplingParams(temperature=0.0)


def state(params=GREEDY, seed=0, outputs=None, prompt=(1, 2, 3)):
    return RowSamplingState(params, seed, list(prompt), list(outputs or []))


def reference_greedy(lanes: list[list[float]], drafts: list[int], k_r: int) -> list[int]:
    """Scalar model of the documented greedy semantics: NaN entries are dropped, +inf entries
    win, a lane with nothing selectable emits 0; a poisoned lane never accepts its draft."""
    out = []
    for j in range(k_r + 1):
        lane = lanes[j]
        values = [(v, i) for i, v in enumerate(lane) if not math.isnan(v)]
        best = max((v for v, _ in values), default=-INF)
        target = 0 if best == -INF else min(i for v, i in values if v == best)
        poisoned = any(math.isnan(v) or v == INF for v in lane) or best == -INF
        if j < k_r and not poisoned and drafts[j] == target:
            out.append(drafts[j])
            continue
        out.append(target)
        break
    return out


def garbage_padding(logits, drafts, num_drafts, gen):
    """Fills every padding lane with +inf/NaN logits and out-of-range draft ids."""
    vocab = logits.shape[-1]
    for r, n in enumerate(num_drafts):
        for j in range(n + 1, logits.shape[1]):
            logits[r, j] = torch.randn(vocab, generator=gen) * 100
            logits[r, j, int(torch.randint(vocab, (1,), generator=gen))] = INF
            logits[r, j, int(torch.randint(vocab, (1,), generator=gen))] = NAN
        for j in range(n, drafts.shape[1]):
            drafts[r, j] = random.Random(r * 31 + j).choice([10**12, -7, vocab, -(2**40)])


# ---------------------------------------------------------------- greedy


def test_greedy_hand_built_batch():
    vocab = 5
    logits = torch.full((4, 4, vocab), -1.0)
    # Row 0: target argmax 1, 2, 3, bonus 4; drafts 1, 2, 3 all accepted.
    # Row 1: target 1, 2, ...; drafts 1, 0 -> accept 1, emit 2 at the mismatch.
    # Row 2: no drafts -> one token, the argmax of lane 0 (3).
    # Row 3: one draft (4) matching -> 4 then the bonus at lane 1 (0).
    for r, targets in enumerate([[1, 2, 3, 4], [1, 2, 3, 4], [3, 0, 0, 0], [4, 0, 2, 2]]):
        for j, t in enumerate(targets):
            logits[r, j, t] = 5.0
    drafts = torch.tensor([[1, 2, 3], [1, 0, 3], [9, 9, 9], [4, 99, -3]])
    out = rejection_sample(logits, drafts, [3, 3, 0, 1], [state() for _ in range(4)])
    assert out.tolist() == [[1, 2, 3, 4], [1, 2], [3], [4, 0]]
    assert out.num_accepted.tolist() == [3, 1, 0, 1]
    assert out.token_ids[1].tolist() == [1, 2, PADDING_TOKEN_ID, PADDING_TOKEN_ID]
    assert out.invalid.tolist() == [False] * 4


@pytest.mark.parametrize("k", range(1, 17))
def test_greedy_matches_scalar_reference(k):
    gen = torch.Generator().manual_seed(k)
    rows, vocab = 12, 7
    logits = torch.randn(rows, k + 1, vocab, generator=gen)
    num_drafts = [int(n) for n in torch.randint(0, k + 1, (rows,), generator=gen)]
    num_drafts[0], num_drafts[1] = k, 0
    drafts = logits.argmax(-1)[:, :k].clone()
    for r in range(rows):  # corrupt one draft in most rows, at a random lane
        if r % 4 != 0:
            drafts[r, int(torch.randint(k, (1,), generator=gen))] += 1
    drafts %= vocab
    for r in range(2, rows, 3):  # NaN or +inf in a real lane of some rows
        j = int(torch.randint(num_drafts[r] + 1, (1,), generator=gen))
        logits[r, j, int(torch.randint(vocab, (1,), generator=gen))] = NAN if r % 2 else INF
    garbage_padding(logits, drafts, num_drafts, gen)

    out = rejection_sample(logits, drafts, num_drafts, [state() for _ in range(rows)])

    for r in range(rows):
        expected = reference_greedy(logits[r].tolist(), drafts[r].tolist(), num_drafts[r])
        assert out.tolist()[r] == expected, r
        assert int(out.num_accepted[r]) == len(expected) - 1
    assert out.num_accepted[0] == k  # an untouched row accepts every draft
    assert len(out.tolist()[1]) == 1


def test_greedy_tie_breaks_to_lowest_id_like_the_plain_sampler():
    logits = torch.tensor([[[0.0, 2.0, 2.0, 1.0], [3.0, 3.0, 0.0, 0.0]]])
    out = rejection_sample(logits, torch.tensor([[2]]), [1], [state()])
    assert out.tolist() == [[1]]  # draft 2 ties with 1 but the argmax is the first maximum
    out = rejection_sample(logits, torch.tensor([[1]]), [1], [state()])
    assert out.tolist() == [[1, 0]]


# ---------------------------------------------------------------- sampled rows


def plain_sampler_token(lane_logits, row: RowSamplingState, history: list[int]) -> int:
    lane_row = RowSamplingState(row.params, row.seed, row.prompt_token_ids, history)
    tokens, _ = sample(lane_logits[None].clone(), [lane_row], -1)
    return tokens[0]


SAMPLED_PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.4),
    SamplingParams(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.7),
    SamplingParams(temperature=1.0, min_tokens=3, eos_token_ids=(2,), stop_token_ids=[4]),
    GREEDY,
    SamplingParams(temperature=0.0, repetition_penalty=2.0),
]


@pytest.mark.parametrize("k", [1, 4, 16])
def test_deterministic_drafts_give_the_plain_samplers_tokens(k):
    """Without draft_probs, a row emits exactly what sampling without speculation draws from the
    same logits and seeds, up to and including the first token that differs from the draft."""
    vocab, rows_n = 16, 3 * len(SAMPLED_PARAMS)
    gen = torch.Generator().manual_seed(100 + k)
    logits = torch.randn(rows_n, k + 1, vocab, generator=gen) * 2
    logits[:, :, 2] += 1.5  # make the eos/stop bans of min_tokens matter
    num_drafts = [int(n) for n in torch.randint(0, k + 1, (rows_n,), generator=gen)]
    rows = [
        state(SAMPLED_PARAMS[r % len(SAMPLED_PARAMS)], seed=1000 + r, outputs=[2, 7][: r % 3])
        for r in range(rows_n)
    ]
    drafts = torch.zeros(rows_n, k, dtype=torch.long)
    expected = []
    pick = random.Random(k)
    for r, row in enumerate(rows):
        history = list(row.output_token_ids)
        emitted = None
        for j in range(num_drafts[r] + 1):
            y = plain_sampler_token(logits[r, j], row, history)
            if j == num_drafts[r]:
                emitted = emitted or [*drafts[r, :j].tolist(), y]
                break
            drafts[r, j] = y if pick.random() < 0.75 else (y + pick.randrange(1, vocab)) % vocab
            if emitted is None and int(drafts[r, j]) != y:
                emitted = [*drafts[r, :j].tolist(), y]
            history.append(int(drafts[r, j]))
        expected.append(emitted)
    garbage_padding(logits, drafts, num_drafts, gen)

    out = rejection_sample(logits, drafts, num_drafts, rows)

    assert out.tolist() == expected
    # Both paths ran: some drafts were accepted and some rows stopped at a rejection.
    assert any(len(e) > 1 for e in expected)
    assert any(len(e) - 1 < n for e, n in zip(expected, num_drafts))


@pytest.mark.parametrize("with_probs", [False, True])
def test_row_tokens_do_not_depend_on_the_batch(with_probs):
    vocab, k = 10, 3
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(1, k + 1, vocab, generator=gen)
    drafts = logits.argmax(-1)[:, :k]
    probs = torch.softmax(torch.randn(1, k, vocab, generator=gen), -1)
    row = state(SamplingParams(temperature=1.0, top_k=6), seed=77, outputs=[3, 4])
    alone = rejection_sample(logits, drafts, [k], [row], probs if with_probs else None)

    big_k, others = 9, 5
    batch_logits = torch.randn(others + 1, big_k + 1, vocab, generator=gen)
    batch_logits[2, : k + 1] = logits[0]
    batch_drafts = torch.randint(vocab, (others + 1, big_k), generator=gen)
    batch_drafts[2, :k] = drafts[0]
    batch_probs = torch.softmax(torch.randn(others + 1, big_k, vocab, generator=gen), -1)
    batch_probs[2, :k] = probs[0]
    num = [big_k, 2, k, 0, 5, 1]
    garbage_padding(batch_logits, batch_drafts, num, gen)
    batch_rows = [state(SamplingParams(temperature=0.5), seed=s) for s in range(others + 1)]
    batch_rows[2] = row
    batched = rejection_sample(
        batch_logits, batch_drafts, num, batch_rows, batch_probs if with_probs else None
    )
    assert batched.tolist()[2] == alone.tolist()[0]


# ---------------------------------------------------------------- empty drafts, padding


@pytest.mark.parametrize("k", [0, 4])
def test_empty_drafts_emit_one_target_token(k):
    vocab, rows_n = 9, 6
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(rows_n, k + 1, vocab, generator=gen)
    drafts = torch.full((rows_n, k), 10**9)
    garbage_padding(logits, drafts, [0] * rows_n, gen)
    rows = [state(GREEDY if r % 2 else SamplingParams(top_p=0.9), seed=r) for r in range(rows_n)]
    out = rejection_sample(logits, drafts, torch.zeros(rows_n, dtype=torch.long), rows)
    expected = [[plain_sampler_token(logits[r, 0], rows[r], [])] for r in range(rows_n)]
    assert out.tolist() == expected
    assert out.num_accepted.tolist() == [0] * rows_n
    assert out.token_ids.shape == (rows_n, k + 1)
    assert (out.token_ids[:, 1:] == PADDING_TOKEN_ID).all()


@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0)])
def test_garbage_in_padding_lanes_changes_nothing(params, with_probs):
    """+inf/NaN logits, out-of-range draft ids and NaN draft probs on padding lanes: same result
    as clean padding, no out-of-bounds gather (CPU gather would raise), no flag."""
    vocab, k, rows_n = 8, 6, 10
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(rows_n, k + 1, vocab, generator=gen)
    drafts = logits.argmax(-1)[:, :k].clone()
    probs = torch.softmax(torch.randn(rows_n, k, vocab, generator=gen), -1)
    num = [int(n) for n in torch.randint(0, k + 1, (rows_n,), generator=gen)]
    rows = [state(params, seed=r) for r in range(rows_n)]
    clean = rejection_sample(logits, drafts, num, rows, probs if with_probs else None)

    dirty_logits, dirty_drafts, dirty_probs = logits.clone(), drafts.clone(), probs.clone()
    garbage_padding(dirty_logits, dirty_drafts, num, gen)
    for r, n in enumerate(num):
        dirty_probs[r, n:] = NAN
    dirty = rejection_sample(
        dirty_logits, dirty_drafts, num, rows, dirty_probs if with_probs else None
    )
    assert dirty.tolist() == clean.tolist()
    assert not dirty.invalid.any()
    for r, tokens in enumerate(dirty.tolist()):
        assert len(tokens) <= num[r] + 1
        assert all(0 <= t < vocab for t in tokens)


def test_padded_lane_with_higher_value_never_wins_over_a_nan_real_lane():
    """The seeds' bug: a real lane holding NaN let a padded lane win the argmax."""
    vocab = 6
    logits = torch.zeros(1, 4, vocab)
    logits[0, 0] = torch.tensor([0.0, NAN, 1.0, 0.5, 0.2, 0.1])  # real lane, NaN at 1
    logits[0, 1:] = INF  # padding lanes hold the largest values there are
    for params in (GREEDY, SamplingParams(temperature=1.0)):
        for seed in range(30):
            out = rejection_sample(logits, torch.tensor([[1, 5, 5]]), [0], [state(params, seed)])
            assert len(out.tolist()[0]) == 1
            assert out.tolist()[0][0] in (0, 2, 3, 4, 5)
            assert out.invalid.tolist() == [True]


def test_race_never_picks_a_zero_weight_entry_even_against_zero_noise():
    """An exponential draw of exactly 0 would make 0/0 = NaN, which torch.argmax picks."""
    weights = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 0.0, 1.0]])
    noise = torch.tensor([[0.0, 1.0, 2.0, 0.0], [0.0, 3.0, 0.0, 0.5]])
    assert _race(weights, noise).tolist() == [1, 3]


# ---------------------------------------------------------------- NaN and +inf in real lanes


@pytest.mark.parametrize("with_probs", [False, True])
def test_nan_in_a_real_lane_stops_the_row_and_recovers_from_finite_entries(with_probs):
    vocab, k = 6, 3
    logits = torch.tensor([[4.0, 0.0, 1.0, 0.0, 0.0, 0.0]] * (k + 1)).repeat(1, 1, 1)
    logits[0, 1] = torch.tensor([0.5, 3.0, NAN, 2.0, -INF, 1.0])  # lane 1: argmax of finite = 1
    drafts = torch.tensor([[0, 1, 0]])  # draft 1 at lane 1 equals the finite argmax
    probs = torch.full((1, k, vocab), 1.0 / vocab)
    draft_probs = probs if with_probs else None

    greedy = rejection_sample(logits, drafts, [k], [state()], draft_probs)
    assert greedy.tolist() == [[0, 1]]  # lane 1 is poisoned: no accept, emit its finite argmax
    assert greedy.invalid.tolist() == [True]

    counts = torch.zeros(vocab, dtype=torch.long)
    for seed in range(400):
        out = rejection_sample(logits, drafts, [k], [state(SamplingParams(), seed)], draft_probs)
        tokens = out.tolist()[0]
        assert out.invalid.tolist() == [True]
        assert len(tokens) <= 2  # never accepts past the poisoned lane
        if len(tokens) == 2:
            counts[tokens[1]] += 1
    assert counts[2] == 0 and counts[4] == 0  # the NaN entry and the -inf entry
    assert counts.sum() > 100 and counts[1] > counts[3] > counts[5] > 0  # softmax order


def test_positive_inf_entries_share_all_the_mass():
    logits = torch.zeros(1, 2, 6)
    logits[0, 0] = torch.tensor([9.0, INF, 0.0, INF, NAN, 0.0])
    greedy = rejection_sample(logits, torch.tensor([[1]]), [1], [state()])
    assert greedy.tolist() == [[1]] and greedy.invalid.tolist() == [True]
    seen = set()
    for seed in range(60):
        out = rejection_sample(logits, torch.tensor([[1]]), [1], [state(SamplingParams(), seed)])
        assert len(out.tolist()[0]) == 1
        seen.add(out.tolist()[0][0])
    assert seen == {1, 3}


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, top_k=2)])
def test_lane_with_nothing_selectable_emits_token_zero_and_is_flagged(params):
    logits = torch.randn(2, 3, 5)
    logits[0, 0, 3] = 50.0  # lane 0 of row 0 is (all but) certain to accept draft 3
    logits[0, 1] = NAN
    logits[1, 0] = -INF
    drafts = logits.nan_to_num(-INF).argmax(-1)[:, :2]
    out = rejection_sample(logits, drafts, [2, 2], [state(params, 1), state(params, 2)])
    assert out.tolist()[0][1] == 0 and len(out.tolist()[0]) == 2
    assert out.tolist()[1] == [0]
    assert out.invalid.tolist() == [True, True]


def test_bad_draft_probs_in_a_real_lane_reject_and_recover_from_the_target():
    vocab = 5
    logits = torch.log(torch.tensor([[[0.1, 0.6, 0.1, 0.1, 0.1]] * 2]))
    probs = torch.full((1, 1, vocab), 0.2)
    for bad in (NAN, INF, -0.5):
        q = probs.clone()
        q[0, 0, 3] = bad
        for seed in range(20):
            row = state(SamplingParams(), seed)
            out = rejection_sample(logits, torch.tensor([[1]]), [1], [row], q)
            plain = plain_sampler_token(logits[0, 0], row, [])
            assert out.tolist() == [[plain]] and out.invalid.tolist() == [True]


def test_real_draft_outside_the_vocabulary_is_rejected():
    vocab = 5
    logits = torch.randn(4, 3, vocab)
    target = logits.argmax(-1)
    drafts = torch.tensor([[vocab, 0], [-1, 0], [10**15, 0], [int(target[3, 0]), vocab + 3]])
    probs = torch.full((4, 2, vocab), 0.2)
    for draft_probs in (None, probs):
        for params in (GREEDY, SamplingParams()):
            rows = [state(params, seed=r) for r in range(4)]
            out = rejection_sample(logits, drafts, [2, 2, 2, 2], rows, draft_probs)
            assert out.num_accepted.tolist()[:3] == [0, 0, 0]
            assert out.num_accepted.tolist()[3] <= 1
            assert all(0 <= t < vocab for row in out.tolist() for t in row)
            assert not out.invalid.any()


def test_masked_and_filtered_tokens_are_never_emitted_or_accepted():
    k, rows_n = 2, 300
    logits = torch.tensor([1.0, 2.0, -INF, 0.5, 3.0, -INF, 0.0, 1.5]).repeat(rows_n, k + 1, 1)
    # The drafter loves the masked tokens 2 and 5 and the top-k-filtered token 6.
    q = torch.tensor([0.02, 0.02, 0.3, 0.02, 0.02, 0.3, 0.3, 0.02]).repeat(rows_n, k, 1)
    drafts = torch.tensor([[2, 5], [5, 6], [6, 2]]).repeat(rows_n // 3, 1)
    rows = [state(SamplingParams(temperature=1.0, top_k=5), seed=s) for s in range(rows_n)]
    for draft_probs in (q, None):
        out = rejection_sample(logits, drafts, [k] * rows_n, rows, draft_probs)
        emitted = {t for row in out.tolist() for t in row}
        assert out.num_accepted.sum() == 0
        assert emitted <= {0, 1, 3, 4, 7} and len(emitted) == 5  # top-5 of the unmasked


# ---------------------------------------------------------------- shapes, bad input


def test_empty_batch():
    out = rejection_sample(torch.randn(0, 3, 5), torch.zeros(0, 2, dtype=torch.long), [], [])
    assert out.tolist() == [] and out.token_ids.shape == (0, 3)


def test_bad_input_names_the_field():
    logits = torch.randn(2, 3, 5)
    drafts = torch.zeros(2, 2, dtype=torch.long)
    rows = [state(), state()]
    with pytest.raises(ValueError, match="num_draft_tokens"):
        rejection_sample(logits, drafts, [3, 0], rows)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        rejection_sample(logits, drafts, [1], rows)
    with pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample(logits, torch.zeros(2, 3, dtype=torch.long), [1, 1], rows)
    with pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample(logits, drafts.float(), [1, 1], rows)
    with pytest.raises(ValueError, match="target_logits"):
        rejection_sample(logits[0], drafts, [1, 1], rows)
    with pytest.raises(ValueError, match="rows"):
        rejection_sample(logits, drafts, [1, 1], rows[:1])
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(logits, drafts, [1, 1], rows, torch.rand(2, 3, 5))


# ---------------------------------------------------------------- distribution (chi-square)

# Upper 0.1% points of the chi-square distribution (standard tables), by degrees of freedom.
CHI2_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}
NUM_DRAWS = 24_000


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the categories with nonzero expected mass, and its dof."""
    support = probs > 0
    assert counts[~support].sum() == 0, f"draws outside the target's support: {counts}"
    expected = probs[support] * counts.sum()
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


def test_chi_square_critical_values_match_the_regularised_gamma():
    for dof, critical in CHI2_CRITICAL_0_001.items():
        tail = torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(critical / 2.0))
        assert float(tail) == pytest.approx(1e-3, rel=2e-3)


TARGETS = torch.tensor(
    [
        [0.30, 0.05, 0.25, 0.0, 0.15, 0.25],  # lane 0 (token 3 masked)
        [0.10, 0.40, 0.05, 0.20, 0.15, 0.10],  # lane 1
        [0.05, 0.05, 0.30, 0.30, 0.10, 0.20],  # lane 2 (bonus)
    ],
    dtype=torch.float64,
)
DRAFTS_Q = torch.tensor(
    [
        [0.10, 0.30, 0.10, 0.20, 0.10, 0.20],  # proposes the masked token 3 a fifth of the time
        [0.25, 0.25, 0.20, 0.10, 0.10, 0.10],
    ],
    dtype=torch.float64,
)


@pytest.mark.parametrize(
    "with_probs,params",
    [
        (True, SamplingParams(temperature=1.0)),
        (False, SamplingParams(temperature=1.0)),
        (True, SamplingParams(temperature=0.8, top_k=4, top_p=0.95)),
    ],
    ids=["draft-probs", "deterministic-draft", "draft-probs-filtered"],
)
def test_emitted_tokens_follow_the_target_distribution(with_probs, params):
    """NUM_DRAWS seeded rows with two drafts drawn from q: the first emitted token follows the
    target at lane 0, the second (given the first draft was accepted) the target at lane 1,
    the third (given both were) the bonus lane's target. Pearson chi-square at alpha = 1e-3,
    critical values in CHI2_CRITICAL_0_001."""
    k, vocab = 2, TARGETS.shape[1]
    logits = TARGETS.log().float().expand(NUM_DRAWS, k + 1, vocab)
    gen = torch.Generator().manual_seed(2024)
    drafts = torch.stack(
        [
            torch.multinomial(DRAFTS_Q[j], NUM_DRAWS, replacement=True, generator=gen)
            for j in range(k)
        ],
        dim=1,
    )
    draft_probs = DRAFTS_Q.float().expand(NUM_DRAWS, k, vocab) if with_probs else None
    rows = [state(params, seed=10_000 + i, outputs=[1] * (i % 5)) for i in range(NUM_DRAWS)]

    out = rejection_sample(logits, drafts, [k] * NUM_DRAWS, rows, draft_probs)

    tokens, accepted = out.token_ids, out.num_accepted
    for lane in range(k + 1):
        target = filter_probs(
            torch.softmax(TARGETS[lane].log() / params.temperature, -1),
            params.top_k,
            params.top_p,
            params.min_p,
        )
        target = target / target.sum()
        reached = accepted >= lane  # rows whose first `lane` drafts were accepted
        counts = torch.bincount(tokens[reached, lane], minlength=vocab).double()
        stat, dof = chi_square(counts, target)
        assert float((target[target > 0] * counts.sum()).min()) >= 5  # chi-square is valid
        p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))
        assert stat < CHI2_CRITICAL_0_001[dof], (lane, stat, p_value, counts.tolist())
        if lane == 0:
            # The test has power: the drafts themselves (distributed as q) fail it badly.
            draft_counts = torch.bincount(drafts[:, 0], minlength=vocab).double()
            draft_counts[target == 0] = 0
            assert chi_square(draft_counts, target)[0] > 10 * CHI2_CRITICAL_0_001[dof]
    # Acceptance happened at the rate rejection sampling predicts (sum of min(p, q)) at lane 0.
    if not params.top_k > 0:
        predicted = float(torch.minimum(TARGETS[0], DRAFTS_Q[0]).sum())
        if not with_probs:  # q is one-hot at the draft: accepted with probability p(draft)
            predicted = float((TARGETS[0] * DRAFTS_Q[0]).sum())
        rate = float((accepted >= 1).double().mean())
        assert rate == pytest.approx(predicted, abs=4 * math.sqrt(predicted / NUM_DRAWS))


# ---------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_cuda_matches_cpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    vocab, k, rows_n = 50, 5, 40
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(rows_n, k + 1, vocab, generator=gen) * 3
    drafts = logits.argmax(-1)[:, :k].clone()
    drafts[::3, 2] += 1
    drafts %= vocab
    num = [int(n) for n in torch.randint(0, k + 1, (rows_n,), generator=gen)]
    logits[5, 0, 3] = NAN
    logits[7, 1, 4] = INF
    garbage_padding(logits, drafts, num, gen)
    probs = torch.softmax(torch.randn(rows_n, k, vocab, generator=gen), -1)
    rows = [state(SAMPLED_PARAMS[r % len(SAMPLED_PARAMS)], seed=r) for r in range(rows_n)]
    for draft_probs in (None, probs):
        cpu = rejection_sample(logits, drafts, num, rows, draft_probs)
        cuda = rejection_sample(
            logits.cuda(),
            drafts.cuda(),
            torch.tensor(num).cuda(),
            rows,
            None if draft_probs is None else draft_probs.cuda(),
        )
        assert cuda.token_ids.device.type == "cuda"
        assert cuda.tolist() == cpu.tolist()
        assert cuda.invalid.cpu().tolist() == cpu.invalid.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_all_greedy_fast_path_matches_the_general_path(dtype):
    """Every row greedy: the fused argmax and max-based poison check (`_greedy_lanes`) give
    the general path's tokens, accepted counts and flags, special values included (a float64
    entry that rounds to float32 +inf counts as +inf, as `.float()` makes it)."""
    from kvloom.workers.sampler import sanitize_logits

    gen = torch.Generator().manual_seed(5)
    rows, lanes, vocab = 12, 4, 33
    logits = torch.randn(rows, lanes, vocab, generator=gen).to(dtype)
    logits[0, 1, 7] = NAN
    logits[1, 0, 3] = INF
    logits[2, 2] = -INF
    logits[3, 0] = NAN
    logits[4, 1, :5] = logits[4, 1].max() + 1  # a tie: the lowest id wins
    if dtype == torch.float64:
        logits[5, 0, 9] = 1e300  # finite in float64, +inf in float32
    drafts = logits.float().nan_to_num(-INF).argmax(-1)[:, : lanes - 1].clone()
    drafts[6, 1] = (drafts[6, 1] + 1) % vocab  # a rejection mid-row
    num_drafts = [3, 3, 3, 3, 3, 3, 3, 2, 1, 0, 3, 3]
    real = torch.arange(lanes)[None, :] <= torch.tensor(num_drafts)[:, None]
    from kvloom.workers.spec_decode.rejection_sampler import _greedy_lanes

    clean, want_poisoned = sanitize_logits(logits.float().clone(), real)
    argmax, poisoned = _greedy_lanes(logits, real)
    assert torch.equal(argmax, clean.argmax(-1)) and torch.equal(poisoned, want_poisoned)
    flagged = [r for r in range(rows) if poisoned[r].any()]
    assert flagged == ([0, 1, 2, 3, 5] if dtype == torch.float64 else [0, 1, 2, 3])

    fast = rejection_sample(logits, drafts, num_drafts, [state() for _ in range(rows)])
    # One sampled row sends the same batch through the general path; greedy rows keep theirs.
    mixed = [state() for _ in range(rows - 1)] + [state(SamplingParams(temperature=0.7), 3)]
    general = rejection_sample(logits, drafts, num_drafts, mixed)
    assert fast.tolist()[:-1] == general.tolist()[:-1]
    assert fast.invalid[:-1].tolist() == general.invalid[:-1].tolist()
    for r in range(rows):
        want = reference_greedy(logits[r].float().tolist(), drafts[r].tolist(), num_drafts[r])
        assert fast.tolist()[r] == want, r
