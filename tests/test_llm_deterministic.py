"""`LLM(deterministic=...)`: the batch-invariant mode's configuration and plan selection.

The mode's promise (greedy and seeded tokens identical alone, batched, chunked, prefix-hit
and preempted) is measured in bfloat16 on the GPU by tests/test_deterministic_gpu.py with
`run_probe_schedules` below; here the CPU runs the same schedules through the references.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from kvloom import LLM, SamplingParams
from kvloom.contracts.config import EngineConfig
from kvloom.kernels import ops
from kvloom.kernels.dispatch import batch_invariant, set_batch_invariant

SETTINGS = dict(dtype="float32", block_size=4, max_num_seqs=4, progress=False)


@pytest.fixture
def mode_off():
    yield
    set_batch_invariant(False)


def test_deterministic_is_a_bool_field(tiny_model):
    path = str(tiny_model("qwen2"))
    assert EngineConfig.from_kwargs(model=path).model.deterministic is False
    assert EngineConfig.from_kwargs(model=path, deterministic=True).model.deterministic
    with pytest.raises(ValueError, match="deterministic must be a bool, got 'yes'"):
        EngineConfig.from_kwargs(model=path, deterministic="yes")


@pytest.mark.parametrize(
    "extra,named",
    [
        (dict(tensor_parallel_size=2), "tensor_parallel_size"),
        (dict(decode_context_parallel_size=2), "decode_context_parallel_size"),
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative"),
    ],
)
def test_settings_without_invariant_plans_are_refused_by_name(tiny_model, extra, named):
    path = str(tiny_model("qwen2", num_key_value_heads=4))
    EngineConfig.from_kwargs(model=path, **extra)  # fine without the mode
    with pytest.raises(ValueError, match=rf"deterministic=True is not supported with {named}"):
        EngineConfig.from_kwargs(model=path, deterministic=True, **extra)


def test_kimi_linear_is_refused_by_name(hybrid_model):
    path = str(hybrid_model("kimi_linear"))
    with pytest.raises(ValueError, match="deterministic=True .* KimiLinearForCausalLM"):
        EngineConfig.from_kwargs(model=path, deterministic=True)


def test_serve_flag_and_helm_value_reach_the_engine():
    from kvloom.cluster.commands import serve
    from tests.helm_render import container, manifests, one, render

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", "m", "--deterministic"])
    assert serve.engine_kwargs(args)["deterministic"] is True
    assert "deterministic" not in serve.engine_kwargs(parser.parse_args(["serve", "--model", "m"]))

    def serve_args(values):
        raycluster = one(manifests(render(values)), "RayCluster")
        return container(raycluster["spec"]["headGroupSpec"]["template"]["spec"], "kvloom")["args"]

    assert "--deterministic" in serve_args({"engine": {"deterministic": True}})
    assert "--deterministic" not in serve_args({})


def test_mode_selects_the_invariant_linear_and_lm_head(mode_off, monkeypatch):
    """With the mode on, every linear (the LM head included) takes the batch-invariant
    GEMM; with it off, the usual path."""
    from kvloom.kernels import batch_invariant as bi
    from kvloom.workers.layers.vocab import ParallelLMHead

    calls = []
    real = bi.linear
    monkeypatch.setattr(bi, "linear", lambda *a: calls.append(a) or real(*a))
    x, w = torch.randn(5, 8), torch.randn(6, 8)
    head = ParallelLMHead(6, 8)
    head.weight.data.copy_(w)
    set_batch_invariant(False)
    ops.linear(x, w)
    head.compute_logits(x)
    assert calls == []
    set_batch_invariant(True)
    torch.testing.assert_close(ops.linear(x, w), x @ w.T)
    torch.testing.assert_close(head.compute_logits(x), x @ w.T)
    assert len(calls) == 2


def test_each_engine_steps_under_its_own_mode(tiny_model, mode_off, monkeypatch):
    """The plans' switch is process-wide, so a deterministic engine built before another
    without the mode must still step with the invariant plans (and the other without)."""
    from kvloom.kernels import batch_invariant as bi

    path = str(tiny_model("qwen2"))
    calls = []
    real = bi.linear
    monkeypatch.setattr(bi, "linear", lambda *a: calls.append(1) or real(*a))
    on = LLM(path, deterministic=True, **SETTINGS)
    off = LLM(path, **SETTINGS)  # its build turned the switch off
    params = SamplingParams(max_tokens=3, temperature=0.0)
    calls.clear()
    off.generate([[5, 6, 7]], params, use_tqdm=False)
    assert calls == [] and not batch_invariant()
    on.generate([[5, 6, 7]], params, use_tqdm=False)
    assert calls and batch_invariant()
    calls.clear()
    off.generate([[5, 6, 7]], params, use_tqdm=False)
    assert calls == []


def test_linear_reference_rows_are_batch_invariant():
    from kvloom.kernels.batch_invariant import linear_ref

    x, w = torch.randn(33, 64, dtype=torch.bfloat16), torch.randn(48, 64, dtype=torch.bfloat16)
    full = linear_ref(x, w)
    for m in (1, 2, 7, 32):
        assert torch.equal(linear_ref(x[:m], w), full[:m])


# -------------------------------------------------------------------- probe schedules

PROBE_PARAMS = [
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
]


def probe_prompts(n: int, vocab: int, seed: int = 0, length=(6, 30)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(length[0], length[1], (n,), generator=g).tolist()
    # A shared 12-token system prefix, so later runs hit the prefix cache.
    prefix = torch.randint(3, vocab, (12,), generator=g).tolist()
    return [prefix + torch.randint(3, vocab, (n_,), generator=g).tolist() for n_ in lens]


def _tokens(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def run_probe_schedules(path, probes, others, settings, preempt_blocks, vocab_params=None):
    """Each probe's tokens (greedy and seeded, interleaved) under five schedules:
    alone; among `others`; chunked prefill; prefix-cache hits; forced preemption.
    Returns {schedule: tokens per probe and params}, and the preemption count."""
    params = vocab_params or PROBE_PARAMS
    base = dict(settings, deterministic=True, enable_prefix_caching=False)
    results, preemptions = {}, 0

    def each(llm, prompts):
        return [_tokens(llm, prompts, p) for p in params]

    llm = LLM(path, **base)
    results["alone"] = [[_tokens(llm, [p], sp)[0] for p in probes] for sp in params]
    mixed = [x for pair in zip(others, probes + [None] * len(others)) for x in pair if x]
    where = [mixed.index(p) for p in probes]
    results["batched"] = [[run[i] for i in where] for run in each(llm, mixed)]
    llm.shutdown()

    chunked = dict(
        max_num_batched_tokens=max(16, settings["max_num_seqs"]), long_prefill_token_threshold=7
    )
    llm = LLM(path, **dict(base, **chunked))
    results["chunked"] = [[run[i] for i in where] for run in each(llm, mixed)]
    llm.shutdown()

    llm = LLM(path, **dict(base, enable_prefix_caching=True))
    each(llm, others)  # warms the cache with the shared prefix
    results["prefix_hit"] = each(llm, probes)
    hits = llm.engine.stats().get("prefix_cache_hits", None)
    llm.shutdown()

    if preempt_blocks is not None:
        llm = LLM(path, **dict(base, num_kv_blocks=preempt_blocks))
        results["preempted"] = [[run[i] for i in where] for run in each(llm, mixed)]
        preemptions = llm.engine.stats()["num_preemptions"]
        llm.shutdown()
    return results, preemptions, hits


def assert_all_schedules_agree(results):
    alone = results["alone"]
    for name, got in results.items():
        for k, (want_runs, got_runs) in enumerate(zip(alone, got)):
            for i, (want, have) in enumerate(zip(want_runs, got_runs)):
                assert have == want, f"{name}: probe {i} params {k}: {have} != alone {want}"


# The hybrid runs without the preemption schedule: with a pool small enough to preempt
# (28-29 pages) its requests end with finish_reason "error", with or without the mode
# (reported to the lead); the GPU test preempts it at a real pool size.
@pytest.mark.parametrize("arch,blocks", [("qwen3", 24), ("qwen3_next", None)])
def test_cpu_probes_identical_under_every_schedule(
    arch, blocks, tiny_model, hybrid_model, mode_off
):
    """The plumbing end to end on the CPU (float32 references): the mode's probes give
    the same greedy and seeded tokens alone, batched, chunked, prefix-hit and preempted."""
    path = str(tiny_model("qwen3") if arch == "qwen3" else hybrid_model("qwen3_next"))
    probes = probe_prompts(3, 200, seed=1)
    others = probe_prompts(5, 200, seed=2)
    results, preemptions, _ = run_probe_schedules(path, probes, others, SETTINGS, blocks)
    assert batch_invariant()  # the engines ran with the mode's plans
    if blocks is not None:
        assert preemptions > 0, "the small pool did not preempt: the schedule tests nothing"
    assert_all_schedules_agree(results)
