"""Helpers for driving an Engine step by step in tests."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

from kvloom import Engine, RequestOutput, SamplingParams

# Eight prompts of different lengths, as token ids inside the tiny vocabulary.
PROMPTS = [
    [5 + (i * 37 + j * 11) % 500 for j in range(length)]
    for i, length in enumerate([1, 3, 7, 16, 17, 31, 33, 50])
]


def greedy(max_tokens: int = 32) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def greedy_with_top2(max_tokens: int = 32) -> SamplingParams:
    """Greedy, reporting each step's top-2 logprobs (their difference is the logit margin)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)


def bf16_ulp(x: float) -> float:
    """One unit in the last place of x in bfloat16 (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0**-133


def assert_greedy_within_bf16_margin(
    reference: Engine,
    prompts: list[list[int]],
    expected: list[RequestOutput],
    got: list[RequestOutput],
    max_ulps: float = 2.0,
) -> list[dict]:
    """The bf16 tensor-parallel rule (issue 24's decision): greedy tokens may leave the
    single-rank reference's only where the reference's top-2 logit margin at that step is
    at most `max_ulps` bf16 ulps of its top logit, and only to its second choice. `expected`
    ran on `reference` with `greedy_with_top2`. Returns (and prints) every divergence with
    its margin; tokens after a divergence continue a different text and are not compared."""
    from tests.oracle_helpers import kvloom_prompt_logits

    divergences = []
    for i, (want, have) in enumerate(zip(expected, got)):
        a, b = want.outputs[0].token_ids, have.outputs[0].token_ids
        assert len(a) == len(b), f"prompt {i}: {len(b)} tokens, the reference made {len(a)}"
        pos = next((p for p, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if pos is None:
            continue
        top2 = sorted(want.outputs[0].logprobs[pos].items(), key=lambda kv: -kv[1].logprob)[:2]
        margin = top2[0][1].logprob - top2[1][1].logprob
        logits = kvloom_prompt_logits(SimpleNamespace(engine=reference), prompts[i] + a[:pos])
        top = float(logits[-1].float().max())
        seen = dict(prompt=i, position=pos, margin=margin, top_logit=top, ulp=bf16_ulp(top))
        print(f"DIVERGENCE {seen} reference {a[pos]} got {b[pos]}")
        divergences.append(seen)
        assert b[pos] == top2[1][0], f"prompt {i} step {pos}: {b[pos]} is not the runner-up"
        assert margin <= max_ulps * bf16_ulp(top), f"prompt {i} step {pos}: margin too wide"
    return divergences


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


def record_steps(model) -> tuple[list, list]:
    """(states, rows) filled as `model` (a kvloom CausalLM) runs: each step's final-norm
    inputs (the last layer's hidden rows and residual, cloned: compared before the logits'
    coarse rounding could hide a difference) and its row count."""
    states, rows = [], []
    model.model.norm.register_forward_hook(
        lambda module, args, out: states.append([a.clone() for a in args])
    )
    model.model.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    return states, rows


def tokens_by_mixed_step_path(monkeypatch, layer_cls, env_name: str, model: str, settings):
    """Greedy tokens of PROMPTS with a linear-attention layer's mixed steps forced through
    each path (`env_name` = chunked, serial, split), under preemption: each run must take
    only its own kernels (split: both within one step) and give every block back."""
    calls = {"serial": 0, "chunked": 0, "both": 0}
    serial_all, chunked_rows = layer_cls._serial_all, layer_cls._chunked_rows
    split_step = layer_cls._split_step

    def counting_serial(*args, **kwargs):
        calls["serial"] += 1
        return serial_all(*args, **kwargs)

    def counting_chunked(self, mixed, g, beta, slots, rows, core):
        calls["chunked"] += bool(rows.prefill_rows)
        return chunked_rows(self, mixed, g, beta, slots, rows, core)

    def counting_split(*args, **kwargs):
        before = dict(calls)
        out = split_step(*args, **kwargs)
        calls["both"] += all(calls[k] > before[k] for k in ("serial", "chunked"))
        return out

    monkeypatch.setattr(layer_cls, "_serial_all", counting_serial)
    monkeypatch.setattr(layer_cls, "_chunked_rows", counting_chunked)
    monkeypatch.setattr(layer_cls, "_split_step", counting_split)
    outs = {}
    for choice in ("chunked", "serial", "split"):
        monkeypatch.setenv(env_name, choice)
        calls.update(serial=0, chunked=0, both=0)
        eng = Engine(model=model, **settings)
        outs[choice] = [o.outputs[0].token_ids for o in run_to_completion(eng, PROMPTS, greedy(12))]
        assert eng.stats()["num_preemptions"] > 0
        assert bool(calls["serial"]) == (choice != "chunked"), (choice, calls)
        assert bool(calls["chunked"]) == (choice != "serial"), (choice, calls)
        assert bool(calls["both"]) == (choice == "split"), (choice, calls)  # one step, two paths
        assert_pool_full(eng)
    return outs


def multi_turn(
    engine: Engine,
    num_conversations: int = 3,
    num_turns: int = 4,
    max_tokens: int = 6,
    seed: int = 0,
) -> list[list[tuple[list[int], RequestOutput]]]:
    """Runs interleaved conversations: turn k's prompt is turn k-1's prompt + its output +
    new user text. Returns, per turn, (prompt, output) for each conversation."""
    import random

    rng = random.Random(seed)
    prompts = [
        [5 + rng.randrange(400) for _ in range(rng.randint(9, 20))]
        for _ in range(num_conversations)
    ]
    turns = []
    for _ in range(num_turns):
        outs = run_to_completion(engine, prompts, greedy(max_tokens))
        turns.append(list(zip(prompts, outs)))
        prompts = [
            p + o.outputs[0].token_ids + [5 + rng.randrange(400) for _ in range(rng.randint(3, 9))]
            for p, o in zip(prompts, outs)
        ]
    return turns


def reusable_prefix(turns, turn: int, block_size: int) -> list[int]:
    """Per conversation: tokens of turn `turn` whose KV the previous turn computed, in
    whole blocks (the previous prompt + output, less the never-fed last token)."""
    out = []
    for prompt, result in turns[turn - 1]:
        computed = len(prompt) + len(result.outputs[0].token_ids) - 1
        out.append(computed // block_size * block_size)
    return out


def kill_worker_mid_run(
    engine: Engine, ray, rank: int = 1, before_kill=None
) -> dict[str, RequestOutput]:
    """Runs every prompt on a Ray-executor engine, kills worker `rank` after three steps
    (calling `before_kill()` first, for checks of the running engine), and checks every
    request then ends in error within 10 s, naming the dead rank. Returns the final
    outputs by request id (the caller checks the engine's state after)."""
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    for _ in range(3):
        engine.step()
    if before_kill is not None:
        before_kill()
    ray.kill(engine.executor.actors[rank])
    start = time.monotonic()
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests() and time.monotonic() - start < 10:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    elapsed = time.monotonic() - start
    assert elapsed < 10, f"requests still pending {elapsed:.1f} s after the kill"
    assert sorted(finished) == sorted(str(i) for i in range(len(PROMPTS)))
    assert {o.outputs[0].finish_reason for o in finished.values()} == {"error"}
    assert f"rank {rank} died" in str(finished["0"].outputs[0].stop_reason)
    return finished


def drafter_of(engine: Engine):
    """The in-process worker's drafter."""
    return engine.executor.worker.runner.draft


def assert_finite_drafter(engine: Engine) -> list:
    """The head's forward never reads a stale (sanitizer-NaN) KV slot: its outputs stay
    finite (the suite runs with KVLOOM_SANITIZE=1). Returns the list of checked calls."""
    import torch

    model = drafter_of(engine).model
    forward = model.forward
    calls = []

    def checked(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append(1)
        for t in out if isinstance(out, tuple) else (out,):
            assert torch.isfinite(t).all(), "the drafter read a stale KV slot"
        return out

    model.forward = checked
    return calls
