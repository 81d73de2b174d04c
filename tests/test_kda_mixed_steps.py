"""KDA's paths for mixed prefill + decode steps (workers/layers/kda_layer.py): the chunked
kernels (the default); every row token by token in place through the serial kernels
(KVLOOM_KDA_MIXED_STEPS=serial; auto takes Gated DeltaNet's rule); or split, long rows
chunked and the rest serial. All give the same tokens."""

from __future__ import annotations

import pytest
import torch

from kvloom import Engine
from kvloom.workers.layers import kda_layer
from kvloom.workers.row_kinds import RowClasses, classify_rows
from tests.engine_helpers import PROMPTS, assert_pool_full, greedy, run_to_completion

CUDA = torch.device("cuda")  # a device object only: nothing is allocated on it
CPU = torch.device("cpu")


def test_mixed_step_path_policy(monkeypatch):
    many_short = RowClasses(classify_rows([0] * 4 + [40] * 4, [512, 300, 7, 1, 1, 1, 1, 9]),
                            [512, 300, 7, 1, 1, 1, 1, 9])  # fmt: skip
    f32 = torch.float32
    monkeypatch.delenv("KVLOOM_KDA_MIXED_STEPS", raising=False)
    assert kda_layer.mixed_step_path(many_short, CUDA, f32) == "chunked"  # the default
    monkeypatch.setenv("KVLOOM_KDA_MIXED_STEPS", "auto")
    assert kda_layer.mixed_step_path(many_short, CUDA, f32) == "serial"
    assert kda_layer.mixed_step_path(many_short, CPU, f32) == "chunked"
    assert kda_layer.mixed_step_path(many_short, CUDA, torch.bfloat16) == "chunked"
    monkeypatch.setenv("KVLOOM_KDA_MIXED_STEPS", "serial")
    assert kda_layer.mixed_step_path(many_short, CPU, torch.bfloat16) == "serial"
    monkeypatch.setenv("KVLOOM_KDA_MIXED_STEPS", "split")
    assert kda_layer.mixed_step_path(many_short, CPU, torch.bfloat16) == "split"
    monkeypatch.setenv("KVLOOM_KDA_MIXED_STEPS", "fast")
    with pytest.raises(ValueError, match="KVLOOM_KDA_MIXED_STEPS"):
        kda_layer.mixed_step_path(many_short, CUDA, f32)


def test_serial_split_and_chunked_mixed_steps_give_the_same_tokens(hybrid_model, monkeypatch):
    """Float64 on the CPU, chunked prefill and preemption under a small pool (sanitizer on:
    a fresh row reading its page would show NaN): the serial and split paths run the mixed
    steps and give the chunked path's tokens, and every block returns to the pool. The
    split's threshold is lowered to 4 tokens so its steps hold both kinds of rows."""
    path = str(hybrid_model("kimi_linear"))
    settings = dict(dtype="float64", device="cpu", block_size=4, max_num_seqs=8,
                    max_num_batched_tokens=12, num_kv_blocks=40, sanitize=True, progress=False)  # fmt: skip
    monkeypatch.setattr(kda_layer, "SPLIT_ROW_TOKENS", 4)
    layer = kda_layer.KimiDeltaAttention
    calls = {"serial": 0, "chunked": 0, "both": 0}
    serial_all, chunked_rows, split_step = layer._serial_all, layer._chunked_rows, layer._split_step

    def counting_serial(*args, **kwargs):
        calls["serial"] += 1
        return serial_all(*args, **kwargs)

    def counting_chunked(*args, **kwargs):
        calls["chunked"] += 1
        return chunked_rows(*args, **kwargs)

    def counting_split(*args, **kwargs):
        before = dict(calls)
        out = split_step(*args, **kwargs)
        calls["both"] += all(calls[k] > before[k] for k in ("serial", "chunked"))
        return out

    monkeypatch.setattr(layer, "_serial_all", counting_serial)
    monkeypatch.setattr(layer, "_chunked_rows", counting_chunked)
    monkeypatch.setattr(layer, "_split_step", counting_split)
    outs = {}
    for choice in ("chunked", "serial", "split"):
        monkeypatch.setenv("KVLOOM_KDA_MIXED_STEPS", choice)
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
