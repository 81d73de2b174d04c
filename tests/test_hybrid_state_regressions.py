"""Seed 000's test plan, the cases the per-model oracle files do not already cover, for both
hybrid models, sanitizer on and off: a step where every row is a fresh one-token prompt,
and zero-length padding rows (which the engine's CPU path never makes, so they are
injected into the model runner's batch) that are neither prefills nor decodes and whose
state pages are never touched."""

from __future__ import annotations

import pytest
import torch

from kvloom import Engine
from kvloom.contracts.kv_cache_spec import LinearStateSpec
from kvloom.contracts.sampling_params import SamplingParams
from kvloom.contracts.scheduler_output import NewRequestData, SchedulerOutput
from kvloom.workers.row_kinds import RowKind
from tests.engine_helpers import assert_pool_full, greedy, run_to_completion

HYBRIDS = ["qwen3_next", "kimi_linear"]
ONE_TOKEN_PROMPTS = [[17], [230], [5], [411]]


def engine(path, sanitize: bool, **kw) -> Engine:
    return Engine(
        model=str(path), dtype="float64", progress=False, block_size=4, sanitize=sanitize, **kw
    )


@pytest.mark.parametrize("sanitize", [True, False])
@pytest.mark.parametrize("arch", HYBRIDS)
def test_every_row_a_fresh_one_token_prompt(hybrid_model, arch, sanitize):
    path = hybrid_model(arch)
    alone = [
        run_to_completion(engine(path, sanitize), [p], greedy(12))[0].outputs[0].token_ids
        for p in ONE_TOKEN_PROMPTS
    ]
    # A first wave finishes and frees its state pages, so the second wave's fresh one-token
    # prompts land on recycled pages (NaN under the sanitizer, stale state without it).
    eng = engine(path, sanitize, enable_prefix_caching=False)
    run_to_completion(eng, [[99, 98, 97, 96, 95]] * 4, greedy(5))
    outs = run_to_completion(eng, ONE_TOKEN_PROMPTS, greedy(12))
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert_pool_full(eng)


@pytest.mark.parametrize("sanitize", [True, False])
@pytest.mark.parametrize("arch", HYBRIDS)
def test_zero_length_padding_rows_are_neither_and_untouched(hybrid_model, arch, sanitize):
    eng = engine(hybrid_model(arch), sanitize, enable_prefix_caching=False)
    runner = eng.executor.worker.runner
    groups = runner.groups
    linear = [g for g, grp in enumerate(groups) if isinstance(grp.spec, LinearStateSpec)]
    assert linear, "a hybrid model has a linear-state group"

    # A state spans pages_per_state pages from its id on: attention blocks come after them.
    span = groups[linear[0]].spec.pages_per_state

    def block_ids(first: int, count: int) -> tuple[list[int], ...]:
        return tuple(
            [first] if g in linear else list(range(first + span, first + span + count))
            for g in range(len(groups))
        )

    prompt = [5, 9, 13, 21, 34, 55]
    real = NewRequestData(
        "real", prompt, SamplingParams(max_tokens=1, temperature=0.0), block_ids(10, 4), 0, 0, 0
    )
    pad = NewRequestData("pad", [7, 7, 7], SamplingParams(max_tokens=1), block_ids(30, 4), 0, 0, 0)
    layers = [
        layer
        for layer in runner.model.cache_layers()
        if isinstance(groups[runner.layer_to_group[layer.layer_index]].spec, LinearStateSpec)
    ]
    marker = 0.123
    for layer in layers:  # the padding row's page holds something recognisable
        for tensor in vars(layer).values():
            if isinstance(tensor, torch.Tensor) and tensor.shape[:1] == (
                eng.kv_cache.pool.num_blocks,
            ):
                tensor[30] = marker
    seen = []
    build = runner.build_batch

    def recording(sched):
        out = build(sched)
        seen.append(out[1].rows)
        return out

    runner.build_batch = recording
    with_pad = runner.execute(
        SchedulerOutput(
            new_requests=[pad, real],
            num_scheduled_tokens={"pad": 0, "real": len(prompt)},
            total_num_scheduled_tokens=len(prompt),
        )
    )
    rows = seen[-1]
    assert rows.kinds == [RowKind.PADDING, RowKind.FRESH]
    assert rows.decode_rows == [] and rows.prefill_rows == [1]
    for layer in layers:
        for tensor in vars(layer).values():
            if isinstance(tensor, torch.Tensor) and tensor.shape[:1] == (
                eng.kv_cache.pool.num_blocks,
            ):
                assert bool((tensor[30] == marker).all()), "padding row's state page changed"
    # The real row's token is the one it gets without the padding row beside it.
    runner.input_batch.requests.clear()
    alone = runner.execute(
        SchedulerOutput(
            new_requests=[
                NewRequestData("real2", prompt, real.sampling_params, block_ids(50, 4), 0, 0, 0)
            ],
            num_scheduled_tokens={"real2": len(prompt)},
            total_num_scheduled_tokens=len(prompt),
        )
    )
    assert with_pad.sampled_token_ids["real"] == alone.sampled_token_ids["real2"]
