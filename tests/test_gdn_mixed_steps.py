"""Gated DeltaNet's paths for mixed prefill + decode steps (workers/layers/gated_deltanet.py):
the chunked kernels; token by token in place through the serial kernels, which CUDA takes
for steps of many short rows (`mixed_step_path`); and split (opt-in): long rows chunked,
the rest serial. All give the same tokens."""

from __future__ import annotations

import pytest
import torch

from kvloom import Engine
from kvloom.kernels import batch_invariant as bi
from kvloom.kernels import dispatch
from kvloom.workers.layers import gated_deltanet as gdn
from kvloom.workers.layers import linear_state_pages as pages
from kvloom.workers.row_kinds import RowClasses, classify_rows
from tests.engine_helpers import PROMPTS, greedy, run_to_completion, tokens_by_mixed_step_path

CUDA = torch.device("cuda")  # a device object only: nothing is allocated on it
CPU = torch.device("cpu")


def rows(computed: list[int], scheduled: list[int]) -> RowClasses:
    return RowClasses(classify_rows(computed, scheduled), scheduled)


def test_mixed_step_path_policy(monkeypatch):
    monkeypatch.delenv("KVLOOM_GDN_MIXED_STEPS", raising=False)
    many_short = rows([0] * 4 + [40] * 4, [512, 300, 7, 1, 1, 1, 1, 2048])
    assert gdn.mixed_step_path(many_short, CUDA) == "serial"
    assert gdn.mixed_step_path(many_short, CPU) == "chunked"  # the CPU keeps chunked
    too_few = rows([0] * 7, [64] * 7)
    assert pages.SERIAL_MIN_ROWS == 8 and gdn.mixed_step_path(too_few, CUDA) == "chunked"
    one_long = rows([0] + [40] * 9, [pages.SERIAL_MAX_ROW_TOKENS + 1] + [1] * 9)
    assert gdn.mixed_step_path(one_long, CUDA) == "chunked"
    for forced in ("serial", "split", "chunked"):  # forced paths ignore device and rows
        monkeypatch.setenv("KVLOOM_GDN_MIXED_STEPS", forced)
        assert gdn.mixed_step_path(too_few, CPU) == forced
    monkeypatch.setenv("KVLOOM_GDN_MIXED_STEPS", "fast")
    with pytest.raises(ValueError, match="KVLOOM_GDN_MIXED_STEPS"):
        gdn.mixed_step_path(many_short, CUDA)


def test_serial_split_and_chunked_mixed_steps_give_the_same_tokens(hybrid_model, monkeypatch):
    """Float64 on the CPU, chunked prefill and preemption under a small pool: the serial
    and split paths (forced) run the mixed steps and give the chunked path's tokens. The
    split's threshold is lowered to 4 tokens so its steps hold both kinds of rows."""
    path = str(hybrid_model("qwen3_next"))
    settings = dict(dtype="float64", device="cpu", block_size=4, max_num_seqs=8,
                    max_num_batched_tokens=24, num_kv_blocks=64, sanitize=True, progress=False)  # fmt: skip
    monkeypatch.setattr(gdn, "SPLIT_ROW_TOKENS", 4)
    outs = tokens_by_mixed_step_path(
        monkeypatch, gdn.GatedDeltaNet, "KVLOOM_GDN_MIXED_STEPS", path, settings
    )
    assert outs["serial"] == outs["chunked"]
    assert outs["split"] == outs["chunked"]


def _spy_serial_engine(hybrid_model, monkeypatch, deterministic, kernel, keyword):
    """An engine on serial mixed steps whose `bi.<kernel>` calls record `keyword`'s value
    into the returned list (the process-wide mode is put back after the test)."""
    asked = []
    real = getattr(bi, kernel)

    def spy(*args, **kwargs):
        asked.append(kwargs[keyword])
        return real(*args, **kwargs)

    monkeypatch.setattr(bi, kernel, spy)
    monkeypatch.setattr(dispatch, "_batch_invariant", dispatch.batch_invariant())
    monkeypatch.setenv("KVLOOM_GDN_MIXED_STEPS", "serial")
    eng = Engine(model=str(hybrid_model("qwen3_next")), dtype="float32", device="cpu",
                 max_num_batched_tokens=16, deterministic=deterministic, progress=False)  # fmt: skip
    return eng, asked


@pytest.mark.parametrize("deterministic", [False, True])
def test_serial_steps_round_the_state_every_token_only_in_the_deterministic_mode(
    hybrid_model, monkeypatch, deterministic
):
    """The deterministic mode asks the serial kernels to round the state after every token
    (chunking a prompt then changes no bits); the default mode's mixed steps ask for one
    rounding a step, as the chunked kernels round (kernels/batch_invariant.py)."""
    eng, asked = _spy_serial_engine(
        hybrid_model, monkeypatch, deterministic, "serial_gated_delta_rule", "round_every_token"
    )
    run_to_completion(eng, PROMPTS[:3], greedy(4))
    assert asked and set(asked) == {deterministic}


@pytest.mark.parametrize("deterministic", [False, True])
def test_serial_conv_is_token_parallel_outside_the_deterministic_mode(
    hybrid_model, monkeypatch, deterministic
):
    """The default mode's mixed steps ask the serial conv for programs over token blocks
    (no chain of a long row's token steps); the deterministic mode keeps the one loop a
    row whose bits its tests established."""
    eng, asked = _spy_serial_engine(
        hybrid_model, monkeypatch, deterministic, "serial_causal_conv1d", "token_parallel"
    )
    run_to_completion(eng, PROMPTS[:3], greedy(4))
    assert asked and set(asked) == {not deterministic}
    asked.clear()
    monkeypatch.setenv("KVLOOM_SERIAL_CONV_LOOP", "1")  # the loop asked for: never parallel
    run_to_completion(eng, PROMPTS[3:5], greedy(4))
    assert asked and set(asked) == {False}
