"""The per-step row split of linear-state layers (workers/linear_rows.py)."""

import pytest
import torch

from kvloom import Engine
from kvloom.workers.attention_metadata import ForwardBatch
from kvloom.workers.layers import gated_deltanet as gdn_layer
from kvloom.workers.layers import kda_layer
from kvloom.workers.linear_rows import build_linear_rows, build_long_rows
from kvloom.workers.row_kinds import RowClasses, classify_rows
from tests.engine_helpers import PROMPTS, assert_pool_full, greedy, run_to_completion


def _rows(computed, scheduled):
    return RowClasses(classify_rows(computed, scheduled), scheduled)


def test_split_matches_the_classification_row_by_row():
    # fresh 3 tokens, resume 1 (decode), padding, resume 4 (chunk), fresh 1 (prefill), resume 1
    computed = [0, 7, 0, 5, 0, 9]
    scheduled = [3, 1, 0, 4, 1, 1]
    starts = [0, 3, 4, 4, 8, 9, 10]
    split = build_linear_rows(_rows(computed, scheduled), starts, "cpu")
    assert split.prefill_rows == [0, 3, 4]
    assert split.decode_rows == [1, 5]
    assert split.prefill_tokens.tolist() == [0, 1, 2, 4, 5, 6, 7, 8]
    assert split.cu_seqlens.tolist() == [0, 3, 7, 8]
    assert split.has_initial_state.tolist() == [False, True, False]
    assert split.prefill_rows_index.tolist() == [0, 3, 4]
    assert split.decode_rows_index.tolist() == [1, 5]
    assert split.decode_tokens.tolist() == [3, 9]
    assert split.prefill_tokens.dtype == split.decode_tokens.dtype == torch.int64
    # The bounds once more on the device, for the chunked kernels of every layer.
    assert split.cu_seqlens_device.tolist() == [0, 3, 7, 8]
    assert split.cu_seqlens_device.dtype == torch.int64


def test_long_rows_are_the_rows_past_the_threshold_as_chunked_rows():
    # fresh 3 tokens, resume 1, padding, resume 4 (a chunk with state), fresh 1, resume 1
    computed = [0, 7, 0, 5, 0, 9]
    scheduled = [3, 1, 0, 4, 1, 1]
    starts = [0, 3, 4, 4, 8, 9, 10]
    long = build_long_rows(_rows(computed, scheduled), starts, "cpu", 2)
    assert long.prefill_rows == [0, 3] and long.decode_rows == []
    assert long.prefill_tokens.tolist() == [0, 1, 2, 4, 5, 6, 7]
    assert long.cu_seqlens.tolist() == [0, 3, 7]
    assert long.has_initial_state.tolist() == [False, True]
    assert long.prefill_rows_index.tolist() == [0, 3]
    assert build_long_rows(_rows(computed, scheduled), starts, "cpu", 4).prefill_rows == []


def test_decode_only_and_prefill_only_steps():
    split = build_linear_rows(_rows([4, 6], [1, 1]), [0, 1, 2], "cpu")
    assert split.prefill_rows == [] and split.cu_seqlens.tolist() == [0]
    assert split.prefill_tokens.numel() == 0 and split.decode_tokens.tolist() == [0, 1]
    split = build_linear_rows(_rows([0], [5]), [0, 5], "cpu")
    assert split.decode_rows == [] and split.prefill_tokens.tolist() == [0, 1, 2, 3, 4]


def test_forward_batch_builds_the_split_once_per_device():
    scheduled = [2, 1]
    batch = ForwardBatch(
        positions=torch.zeros(3, dtype=torch.int64),
        query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32),
        seq_lens=torch.tensor([2, 5]),
        num_computed_tokens=torch.tensor([0, 4]),
        query_start_loc_list=[0, 2, 3],
        seq_lens_list=[2, 5],
        rows=_rows([0, 4], scheduled),
    )
    first = batch.linear_rows("cpu")
    assert batch.linear_rows("cpu") is first
    assert first.prefill_tokens.tolist() == [0, 1] and first.decode_tokens.tolist() == [2]


@pytest.mark.parametrize(
    ("arch", "module", "kernel"),
    [("qwen3_next", gdn_layer, "chunk_gated_delta_rule"), ("kimi_linear", kda_layer, "chunk_kda")],
)
def test_every_linear_layer_of_a_step_passes_the_steps_one_device_bounds(
    hybrid_model, monkeypatch, arch, module, kernel
):
    """The chunked kernels get the step's host bounds and their one device copy
    (LinearRows.cu_seqlens_device): the same objects in every layer, so fla waits for the
    stream once per step rather than once per layer (it did, in Kimi-Linear's mixed steps)."""
    monkeypatch.setenv("KVLOOM_GDN_MIXED_STEPS", "chunked")
    real, calls = getattr(module, kernel), []

    def spy(*args, **kwargs):
        calls.append((args[5], kwargs["cu_seqlens_device"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, kernel, spy)
    engine = Engine(model=str(hybrid_model(arch)), dtype="float32", device="cpu")
    run_to_completion(engine, PROMPTS[:3], greedy(4))
    steps = {}
    for host, device in calls:
        steps.setdefault(id(device), []).append((host, device))
    assert calls and all(len(layers) >= 2 for layers in steps.values())
    for layers in steps.values():
        host, device = layers[0]
        assert all(h is host and d is device for h, d in layers)  # one pair per step
        assert device.tolist() == host.tolist() and device.dtype == torch.int64
    assert_pool_full(engine)
