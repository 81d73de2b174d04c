"""Gated DeltaNet's two paths for mixed prefill + decode steps (workers/layers/gated_deltanet.py):
the chunked kernels, and token by token in place through the serial kernels, which CUDA
takes for steps of many short rows (`serial_mixed_step`). Both give the same tokens."""

from __future__ import annotations

import pytest
import torch

from kvloom import Engine
from kvloom.workers.layers import gated_deltanet as gdn
from kvloom.workers.row_kinds import RowClasses, classify_rows
from tests.engine_helpers import PROMPTS, assert_pool_full, greedy, run_to_completion

CUDA = torch.device("cuda")  # a device object only: nothing is allocated on it
CPU = torch.device("cpu")


def rows(computed: list[int], scheduled: list[int]) -> RowClasses:
    return RowClasses(classify_rows(computed, scheduled), scheduled)


def test_serial_mixed_step_policy(monkeypatch):
    monkeypatch.delenv("KVLOOM_GDN_MIXED_STEPS", raising=False)
    many_short = rows([0] * 4 + [40] * 4, [512, 300, 7, 1, 1, 1, 1, 2048])
    f32 = torch.float32
    assert gdn.serial_mixed_step(many_short, CUDA, f32)
    assert not gdn.serial_mixed_step(many_short, CPU, f32)  # the CPU keeps the chunked path
    assert not gdn.serial_mixed_step(many_short, CUDA, torch.bfloat16)  # rounded per token
    too_few = rows([0] * 7, [64] * 7)
    assert gdn.SERIAL_MIN_ROWS == 8 and not gdn.serial_mixed_step(too_few, CUDA, f32)
    one_long = rows([0] + [40] * 9, [gdn.SERIAL_MAX_ROW_TOKENS + 1] + [1] * 9)
    assert not gdn.serial_mixed_step(one_long, CUDA, f32)
    monkeypatch.setenv("KVLOOM_GDN_MIXED_STEPS", "serial")
    assert gdn.serial_mixed_step(too_few, CPU, torch.bfloat16)
    monkeypatch.setenv("KVLOOM_GDN_MIXED_STEPS", "chunked")
    assert not gdn.serial_mixed_step(many_short, CUDA, f32)
    monkeypatch.setenv("KVLOOM_GDN_MIXED_STEPS", "fast")
    with pytest.raises(ValueError, match="KVLOOM_GDN_MIXED_STEPS"):
        gdn.serial_mixed_step(many_short, CUDA, f32)


def test_serial_and_chunked_mixed_steps_give_the_same_tokens(hybrid_model, monkeypatch):
    """Float64 on the CPU, chunked prefill and preemption under a small pool: the serial
    path (forced) runs the mixed steps and gives the chunked path's tokens."""
    path = str(hybrid_model("qwen3_next"))
    settings = dict(dtype="float64", device="cpu", block_size=4, max_num_seqs=8,
                    max_num_batched_tokens=24, num_kv_blocks=64, sanitize=True, progress=False)  # fmt: skip
    calls = []
    serial_all = gdn.GatedDeltaNet._serial_all

    def counting(*args, **kwargs):
        calls.append(1)
        return serial_all(*args, **kwargs)

    monkeypatch.setattr(gdn.GatedDeltaNet, "_serial_all", counting)
    outs = {}
    for choice in ("chunked", "serial"):
        monkeypatch.setenv("KVLOOM_GDN_MIXED_STEPS", choice)
        calls.clear()
        eng = Engine(model=path, **settings)
        outs[choice] = [o.outputs[0].token_ids for o in run_to_completion(eng, PROMPTS, greedy(12))]
        assert eng.stats()["num_preemptions"] > 0
        assert bool(calls) == (choice == "serial")
        assert_pool_full(eng)
    assert outs["serial"] == outs["chunked"]
