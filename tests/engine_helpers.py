"""Helpers for driving an Engine step by step in tests."""

from __future__ import annotations

from kvloom import Engine, RequestOutput, SamplingParams

# Eight prompts of different lengths, as token ids inside the tiny vocabulary.
PROMPTS = [
    [5 + (i * 37 + j * 11) % 500 for j in range(length)]
    for i, length in enumerate([1, 3, 7, 16, 17, 31, 33, 50])
]


def greedy(max_tokens: int = 32) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_to_completion(
    engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> list[RequestOutput]:
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    ids = []
    for prompt, p in zip(prompts, params_list):
        rid = engine.next_request_id()
        engine.add_request(rid, {"prompt_token_ids": prompt}, p)
        ids.append(rid)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[rid] for rid in ids]


def assert_pool_full(engine: Engine) -> None:
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
