"""Seeded sampling is reproducible whatever else is batched; filters behave."""

from __future__ import annotations

import pytest
import torch

from kvloom import Engine, SamplingParams
from kvloom.workers.sampler import filter_probs
from tests.engine_helpers import PROMPTS, run_to_completion


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("qwen3"))


def engine(model_dir, **kw):
    kw.setdefault("dtype", "float64")
    return Engine(model=model_dir, progress=False, block_size=8, **kw)


def seeded(seed, **kw):
    kw.setdefault("temperature", 1.0)
    kw.setdefault("max_tokens", 20)
    return SamplingParams(seed=seed, ignore_eos=True, **kw)


def test_same_seed_same_tokens_alone_or_batched(model_dir):
    params = seeded(1234, top_p=0.9, top_k=50)
    alone = run_to_completion(engine(model_dir), [PROMPTS[4]], params)[0].outputs[0].token_ids
    others = [seeded(7 + i) for i in range(len(PROMPTS))]
    batch_params = others[:4] + [params] + others[5:]
    batched = run_to_completion(engine(model_dir, max_num_batched_tokens=7), PROMPTS, batch_params)
    assert batched[4].outputs[0].token_ids == alone


def test_same_seed_survives_preemption(model_dir):
    params = [seeded(100 + i) for i in range(len(PROMPTS))]
    free = run_to_completion(engine(model_dir), PROMPTS, params)
    tight = engine(model_dir, num_kv_blocks=20, enable_prefix_caching=False)
    squeezed = run_to_completion(tight, PROMPTS, params)
    assert tight.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in squeezed] == [o.outputs[0].token_ids for o in free]


def test_different_seeds_differ(model_dir):
    outs = run_to_completion(engine(model_dir), [PROMPTS[5]] * 4, [seeded(s) for s in range(4)])
    sequences = {tuple(o.outputs[0].token_ids) for o in outs}
    assert len(sequences) == 4


def test_top_k_one_is_greedy(model_dir):
    greedy = run_to_completion(
        engine(model_dir), [PROMPTS[6]], SamplingParams(max_tokens=12, temperature=0.0)
    )
    top1 = run_to_completion(engine(model_dir), [PROMPTS[6]], seeded(3, top_k=1, max_tokens=12))
    assert greedy[0].outputs[0].token_ids == top1[0].outputs[0].token_ids


@pytest.mark.parametrize("temperature", [1e-40, 1e-7])
def test_a_tiny_temperature_is_greedy(model_dir, temperature):
    """In float32 logits / 1e-40 overflow to inf and the softmax to NaN; below 1e-5 the
    request samples greedily instead (vLLM's rule), never from a NaN distribution."""
    f32 = dict(dtype="float32")
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tiny = SamplingParams(max_tokens=8, temperature=temperature, seed=5, ignore_eos=True)
    want = run_to_completion(engine(model_dir, **f32), [PROMPTS[6]], greedy)[0].outputs[0]
    got = run_to_completion(engine(model_dir, **f32), [PROMPTS[6]], tiny)[0].outputs[0]
    assert got.token_ids == want.token_ids and len(got.token_ids) == 8
    assert SamplingParams(temperature=2e-5).greedy is False


def test_logprobs_returned_and_consistent(model_dir):
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=3, ignore_eos=True)
    out = run_to_completion(engine(model_dir), [PROMPTS[3]], params)[0].outputs[0]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        assert len(entry) == 3
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs))
    )


def test_filters_keep_expected_tokens():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64)
    assert filter_probs(probs, 2, 1.0, 0.0).nonzero().flatten().tolist() == [0, 1]
    assert filter_probs(probs, -1, 0.6, 0.0).nonzero().flatten().tolist() == [0, 1]
    assert filter_probs(probs, -1, 0.45, 0.0).nonzero().flatten().tolist() == [0]
    assert filter_probs(probs, -1, 1.0, 0.3).nonzero().flatten().tolist() == [0, 1, 2]


def test_sampled_distribution_follows_probabilities(model_dir):
    """Over many seeds, token frequencies at the first step follow softmax(logits)."""
    e = engine(model_dir)
    params = [SamplingParams(max_tokens=1, seed=s, temperature=2.0, top_k=4) for s in range(400)]
    outs = run_to_completion(e, [PROMPTS[2]] * 400, params)
    counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[0] for o in outs]))
    assert (counts > 0).sum() <= 4  # top_k = 4
    assert (counts > 0).sum() >= 2  # and it really samples


def test_plain_sampler_is_nan_safe():
    """Invariant 5 for plain rows: NaN never wins an argmax, zero-probability entries never
    win the race, and the rules match the rejection sampler's."""
    from kvloom.workers.sampler import RowSamplingState, sample

    logits = torch.tensor(
        [
            [0.0, float("nan"), 5.0, 1.0],
            [float("nan")] * 4,
            [0.0, float("inf"), 1.0, float("inf")],
            [1.0, 2.0, float("nan"), 0.0],
        ]
    )
    greedy_params = SamplingParams(temperature=0.0)
    rows = [RowSamplingState(greedy_params, 0, [1], []) for _ in range(3)]
    rows.append(RowSamplingState(SamplingParams(temperature=1.0, top_k=1), 3, [1], []))
    tokens, _ = sample(logits, rows, -1)
    assert tokens[0] == 2  # not the NaN lane
    assert tokens[1] == 0  # nothing selectable: token 0 by convention
    assert tokens[2] in (1, 3)  # +inf entries share the mass
    assert tokens[3] == 1  # top-1 of the finite entries


def test_final_only_outputs_come_once_at_the_end(tiny_model):
    from kvloom import Engine, SamplingParams

    engine = Engine(model=str(tiny_model("llama")), progress=False)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("c", {"prompt_token_ids": [5, 6, 7]}, greedy)
    params = SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True, output_kind="final_only"
    )
    engine.add_request("f", {"prompt_token_ids": [5, 6, 7]}, params)
    seen = {"c": [], "f": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen["c"]) == 4 and [o.finished for o in seen["f"]] == [True]
    assert seen["f"][0].outputs[0].token_ids == seen["c"][-1].outputs[0].token_ids
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")


def test_plain_greedy_steps_skip_per_row_sampling_state(model_dir, monkeypatch):
    """Steps whose rows are all plain greedy go straight to the fused argmax, with the same
    tokens as the per-row path; one row asking for logprobs (or a penalty, min_tokens, a
    sampled temperature) sends its step through the per-row path again."""
    from kvloom.workers.model_runner import ModelRunner

    built = []
    real = ModelRunner._sampling_state

    def spy(self, request_id, history=False):
        built.append(request_id)
        return real(self, request_id, history)

    monkeypatch.setattr(ModelRunner, "_sampling_state", spy)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    fast = run_to_completion(Engine(model=model_dir, progress=False), PROMPTS[:4], greedy)
    assert built == []
    engine = Engine(model=model_dir, progress=False)
    runner = engine.executor.worker.runner
    apply = runner.input_batch.apply

    def without_fast_path(sched):
        apply(sched)
        for state in runner.input_batch.requests.values():
            state.plain_greedy = False

    monkeypatch.setattr(runner.input_batch, "apply", without_fast_path)
    slow = run_to_completion(engine, PROMPTS[:4], greedy)
    assert built and [o.outputs[0].token_ids for o in fast] == [
        o.outputs[0].token_ids for o in slow
    ]
    built.clear()
    mixed = [greedy] * 3 + [SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)]
    run_to_completion(Engine(model=model_dir, progress=False), PROMPTS[:4], mixed)
    assert built  # the logprobs row's steps build every row's state
