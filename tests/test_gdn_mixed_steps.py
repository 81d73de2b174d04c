"""Gated DeltaNet's paths for mixed prefill + decode steps (workers/layers/gated_deltanet.py):
the chunked kernels; token by token in place through the serial kernels, which CUDA takes
for steps of many short rows (`mixed_step_path`); and split (opt-in): long rows chunked,
the rest serial. All give the same tokens."""

from __future__ import annotations

import pytest
import torch

from kvloom import Engine
from kvloom.workers.layers import gated_deltanet as gdn
from kvloom.workers.layers import linear_state_pages as pages
from kvloom.workers.row_kinds import RowClasses, classify_rows
from tests.engine_helpers import PROMPTS, assert_pool_full, greedy, run_to_completion

CUDA = torch.device("cuda")  # a device object only: nothing is allocated on it
CPU = torch.device("cpu")


def rows(computed: list[int], scheduled: list[int]) -> RowClasses:
    return RowClasses(classify_rows(computed, scheduled), scheduled)


def test_mixed_step_path_policy(monkeypatch):
    monkeypatch.delenv("KVLOOM_GDN_MIXED_STEPS", raising=False)
    many_short = rows([0] * 4 + [40] * 4, [512, 300, 7, 1, 1, 1, 1, 2048])
    f32 = torch.float32
    assert gdn.mixed_step_path(many_short, CUDA, f32) == "serial"
    assert gdn.mixed_step_path(many_short, CPU, f32) == "chunked"  # the CPU keeps chunked
    assert gdn.mixed_step_path(many_short, CUDA, torch.bfloat16) == "chunked"  # rounded per token
    too_few = rows([0] * 7, [64] * 7)
    assert pages.SERIAL_MIN_ROWS == 8 and gdn.mixed_step_path(too_few, CUDA, f32) == "chunked"
    one_long = rows([0] + [40] * 9, [pages.SERIAL_MAX_ROW_TOKENS + 1] + [1] * 9)
    assert gdn.mixed_step_path(one_long, CUDA, f32) == "chunked"
    for forced in ("serial", "split", "chunked"):  # forced paths ignore device and rows
        monkeypatch.setenv("KVLOOM_GDN_MIXED_STEPS", forced)
        assert gdn.mixed_step_path(too_few, CPU, torch.bfloat16) == forced
    monkeypatch.setenv("KVLOOM_GDN_MIXED_STEPS", "fast")
    with pytest.raises(ValueError, match="KVLOOM_GDN_MIXED_STEPS"):
        gdn.mixed_step_path(many_short, CUDA, f32)


def test_serial_split_and_chunked_mixed_steps_give_the_same_tokens(hybrid_model, monkeypatch):
    """Float64 on the CPU, chunked prefill and preemption under a small pool: the serial
    and split paths (forced) run the mixed steps and give the chunked path's tokens. The
    split's threshold is lowered to 4 tokens so its steps hold both kinds of rows."""
    path = str(hybrid_model("qwen3_next"))
    settings = dict(dtype="float64", device="cpu", block_size=4, max_num_seqs=8,
                    max_num_batched_tokens=24, num_kv_blocks=64, sanitize=True, progress=False)  # fmt: skip
    monkeypatch.setattr(gdn, "SPLIT_ROW_TOKENS", 4)
    calls = {"serial": 0, "chunked": 0, "both": 0}
    serial_all, chunked_rows = gdn.GatedDeltaNet._serial_all, gdn.GatedDeltaNet._chunked_rows
    split_step = gdn.GatedDeltaNet._split_step

    def counting_serial(*args, **kwargs):
        calls["serial"] += 1
        return serial_all(*args, **kwargs)

    def counting_chunked(self, mixed, g, beta, slots, rows_, core):
        calls["chunked"] += bool(rows_.prefill_rows)
        return chunked_rows(self, mixed, g, beta, slots, rows_, core)

    def counting_split(self, *args, **kwargs):
        before = dict(calls)
        out = split_step(self, *args, **kwargs)
        calls["both"] += all(calls[k] > before[k] for k in ("serial", "chunked"))
        return out

    monkeypatch.setattr(gdn.GatedDeltaNet, "_serial_all", counting_serial)
    monkeypatch.setattr(gdn.GatedDeltaNet, "_chunked_rows", counting_chunked)
    monkeypatch.setattr(gdn.GatedDeltaNet, "_split_step", counting_split)
    outs = {}
    for choice in ("chunked", "serial", "split"):
        monkeypatch.setenv("KVLOOM_GDN_MIXED_STEPS", choice)
        calls.update(serial=0, chunked=0, both=0)
        eng = Engine(model=path, **settings)
        outs[choice] = [o.outputs[0].token_ids for o in run_to_completion(eng, PROMPTS, greedy(12))]
        assert eng.stats()["num_preemptions"] > 0
        assert bool(calls["serial"]) == (choice != "chunked"), (choice, calls)
        assert bool(calls["chunked"]) == (choice != "serial"), (choice, calls)
        assert bool(calls["both"]) == (choice == "split"), (choice, calls)  # one step, two paths
        assert_pool_full(eng)
    assert outs["serial"] == outs["chunked"]
    assert outs["split"] == outs["chunked"]
