"""KDA's paths for mixed prefill + decode steps (workers/layers/kda_layer.py): the chunked
kernels; every row token by token in place through the serial kernels
(KVLOOM_KDA_MIXED_STEPS=serial; the default, auto, takes Gated DeltaNet's rule); or split,
long rows chunked and the rest serial. All give the same tokens."""

from __future__ import annotations

import pytest
import torch

from kvloom.workers.layers import kda_layer
from kvloom.workers.row_kinds import RowClasses, classify_rows
from tests.engine_helpers import tokens_by_mixed_step_path

CUDA = torch.device("cuda")  # a device object only: nothing is allocated on it
CPU = torch.device("cpu")


def test_mixed_step_path_policy(monkeypatch):
    many_short = RowClasses(classify_rows([0] * 4 + [40] * 4, [512, 300, 7, 1, 1, 1, 1, 9]),
                            [512, 300, 7, 1, 1, 1, 1, 9])  # fmt: skip
    monkeypatch.delenv("KVLOOM_KDA_MIXED_STEPS", raising=False)
    assert kda_layer.mixed_step_path(many_short, CUDA) == "serial"  # the default: auto
    monkeypatch.setenv("KVLOOM_KDA_MIXED_STEPS", "chunked")
    assert kda_layer.mixed_step_path(many_short, CUDA) == "chunked"
    monkeypatch.setenv("KVLOOM_KDA_MIXED_STEPS", "auto")
    assert kda_layer.mixed_step_path(many_short, CUDA) == "serial"  # any state dtype
    assert kda_layer.mixed_step_path(many_short, CPU) == "chunked"
    too_few = RowClasses(classify_rows([0] * 7, [64] * 7), [64] * 7)
    assert kda_layer.mixed_step_path(too_few, CUDA) == "chunked"
    monkeypatch.setenv("KVLOOM_KDA_MIXED_STEPS", "serial")
    assert kda_layer.mixed_step_path(many_short, CPU) == "serial"
    monkeypatch.setenv("KVLOOM_KDA_MIXED_STEPS", "split")
    assert kda_layer.mixed_step_path(many_short, CPU) == "split"
    monkeypatch.setenv("KVLOOM_KDA_MIXED_STEPS", "fast")
    with pytest.raises(ValueError, match="KVLOOM_KDA_MIXED_STEPS"):
        kda_layer.mixed_step_path(many_short, CUDA)


def test_serial_split_and_chunked_mixed_steps_give_the_same_tokens(hybrid_model, monkeypatch):
    """Float64 on the CPU, chunked prefill and preemption under a small pool (sanitizer on:
    a fresh row reading its page would show NaN): the serial and split paths run the mixed
    steps and give the chunked path's tokens, and every block returns to the pool. The
    split's threshold is lowered to 4 tokens so its steps hold both kinds of rows."""
    path = str(hybrid_model("kimi_linear"))
    settings = dict(dtype="float64", device="cpu", block_size=4, max_num_seqs=8,
                    max_num_batched_tokens=12, num_kv_blocks=40, sanitize=True, progress=False)  # fmt: skip
    monkeypatch.setattr(kda_layer, "SPLIT_ROW_TOKENS", 4)
    outs = tokens_by_mixed_step_path(
        monkeypatch, kda_layer.KimiDeltaAttention, "KVLOOM_KDA_MIXED_STEPS", path, settings
    )
    assert outs["serial"] == outs["chunked"]
    assert outs["split"] == outs["chunked"]
