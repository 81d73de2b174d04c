"""KDA's paths for mixed prefill + decode steps (workers/layers/kda_layer.py): the chunked
kernels (the default), or every row token by token in place through the serial kernels
(KVLOOM_KDA_MIXED_STEPS=serial; auto takes Gated DeltaNet's rule). Both give the same
tokens."""

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
    monkeypatch.setenv("KVLOOM_KDA_MIXED_STEPS", "split")  # Gated DeltaNet's only
    with pytest.raises(ValueError, match="KVLOOM_KDA_MIXED_STEPS"):
        kda_layer.mixed_step_path(many_short, CUDA, f32)


def test_serial_and_chunked_mixed_steps_give_the_same_tokens(hybrid_model, monkeypatch):
    """Float64 on the CPU, chunked prefill and preemption under a small pool (sanitizer on:
    a fresh row reading its page would show NaN): the serial path runs the mixed steps and
    gives the chunked path's tokens, and every block returns to the pool."""
    path = str(hybrid_model("kimi_linear"))
    settings = dict(dtype="float64", device="cpu", block_size=4, max_num_seqs=8,
                    max_num_batched_tokens=24, num_kv_blocks=40, sanitize=True, progress=False)  # fmt: skip
    calls = {"serial": 0, "chunked": 0}
    serial_all, mixed_rows = (
        kda_layer.KimiDeltaAttention._serial_all,
        kda_layer.KimiDeltaAttention._mixed_rows,
    )

    def counting_serial(*args, **kwargs):
        calls["serial"] += 1
        return serial_all(*args, **kwargs)

    def counting_chunked(*args, **kwargs):
        calls["chunked"] += 1
        return mixed_rows(*args, **kwargs)

    monkeypatch.setattr(kda_layer.KimiDeltaAttention, "_serial_all", counting_serial)
    monkeypatch.setattr(kda_layer.KimiDeltaAttention, "_mixed_rows", counting_chunked)
    outs = {}
    for choice in ("chunked", "serial"):
        monkeypatch.setenv("KVLOOM_KDA_MIXED_STEPS", choice)
        calls.update(serial=0, chunked=0)
        eng = Engine(model=path, **settings)
        outs[choice] = [o.outputs[0].token_ids for o in run_to_completion(eng, PROMPTS, greedy(12))]
        assert eng.stats()["num_preemptions"] > 0
        assert bool(calls["serial"]) == (choice == "serial"), (choice, calls)
        assert bool(calls["chunked"]) == (choice == "chunked"), (choice, calls)
        assert_pool_full(eng)
    assert outs["serial"] == outs["chunked"]
