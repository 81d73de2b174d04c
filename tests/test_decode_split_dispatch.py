"""Which paged-attention kernel a step's attention layers run: the split-KV decode for
uniform-decode steps (every row a true one-token decode by the one row classification,
what decode CUDA graphs capture), outside the deterministic mode; the one-pass kernel for
every other step and for every step of the deterministic mode. `ForwardBatch` decides it
once (`split_decode`) and the attention layer passes that on (invariants 1 and 3).

The decision is host logic, tested on the CPU. The last test also runs the split-KV
kernel (Triton's interpreter, float32) inside a CPU engine whose decode steps replay
stand-in graphs (EagerStepGraph), so the graph's scratch, padding rows and bounds go
through the real kernel, and checks the tokens against the torch reference engine.
"""

from __future__ import annotations

import os

import pytest
import torch
from engine_helpers import PROMPTS, assert_pool_full, greedy, run_to_completion

from kvloom import Engine
from kvloom.kernels import ops
from kvloom.kernels.dispatch import batch_invariant, set_batch_invariant
from kvloom.workers.attention_metadata import (
    SPLIT_DECODE_MAX_ROWS,
    DecodeSplitScratch,
    ForwardBatch,
)
from kvloom.workers.cuda_graphs import StaticBatch, capture_sizes
from kvloom.workers.graph_capture import EagerStepGraph
from kvloom.workers.layers import attention as attention_layer
from kvloom.workers.row_kinds import RowClasses, RowKind, classify_rows

RESUME, FRESH = RowKind.RESUME, RowKind.FRESH


@pytest.fixture
def mode():
    """Sets the process's deterministic-mode switch for a test and restores it after."""
    before = batch_invariant()
    yield set_batch_invariant
    set_batch_invariant(before)


def forward_batch(computed: list[int], scheduled: list[int], **kwargs) -> ForwardBatch:
    """A ForwardBatch with the host layout of rows that computed `computed` tokens before
    and run `scheduled` now (decode_only as the model runner sets it)."""
    rows = RowClasses(classify_rows(computed, scheduled), scheduled)
    starts = [0]
    for n in scheduled:
        starts.append(starts[-1] + n)
    ends = [c + n for c, n in zip(computed, scheduled)]
    t = torch.tensor
    return ForwardBatch(
        positions=t(range(starts[-1])),
        query_start_loc=t(starts, dtype=torch.int32),
        seq_lens=t(ends, dtype=torch.int32),
        num_computed_tokens=t(computed, dtype=torch.int32),
        query_start_loc_list=starts,
        seq_lens_list=ends,
        rows=rows,
        decode_only=rows.uniform_decode(1) and starts[-1] == len(scheduled),
        **kwargs,
    )


@pytest.mark.parametrize(
    ("computed", "scheduled", "split"),
    [
        ([5, 300, 9], [1, 1, 1], True),  # true decodes
        ([5, 0, 9], [1, 1, 1], False),  # a one-token fresh prompt beside them
        ([5, 300], [1, 4], False),  # a prefill chunk resuming
        ([5, 300], [3, 3], False),  # verification rows (1 + 2 drafts)
        ([0], [7], False),
    ],
)
def test_split_decode_follows_the_row_classification(mode, computed, scheduled, split):
    mode(False)
    batch = forward_batch(computed, scheduled)
    assert (batch.split_decode is not None) == split
    if split:
        # An eager step: its own longest row bounds the grid; partials made per call.
        assert batch.split_decode.max_seq_len == max(batch.seq_lens_list)
        assert batch.split_decode.scratch is None


def test_deterministic_mode_keeps_the_one_pass_kernel(mode):
    mode(True)
    assert forward_batch([5, 300, 9], [1, 1, 1]).split_decode is None
    mode(False)
    assert forward_batch([5, 300, 9], [1, 1, 1]).split_decode is not None


def test_only_small_decode_steps_split(mode):
    """Where the one-pass grid already fills the GPU the split decode was slower on the
    H200 (0.57-0.85x at 64 and 256 rows), so larger steps keep the one-pass kernel."""
    mode(False)
    n = SPLIT_DECODE_MAX_ROWS
    assert forward_batch([300] * n, [1] * n).split_decode is not None
    assert forward_batch([300] * (n + 1), [1] * (n + 1)).split_decode is None
    decode = StaticBatch([], {}, torch.device("cpu"), 4 * n, 1, 640)
    assert decode.view(n).split_decode is not None
    assert decode.view(n + 1).split_decode is None
    assert decode.split_scratch.max_rows == n  # sized for the graphs that split only


@pytest.mark.parametrize("deterministic", [False, True])
def test_graph_batches_carry_the_bound_and_scratch(mode, deterministic):
    """A decode graph's batch: bounded by max_model_len (its host layout is made up), the
    static batch's one scratch; a verification graph's (3 tokens a row) never splits."""
    mode(deterministic)
    decode = StaticBatch([], {}, torch.device("cpu"), 8, 1, 640)
    verify = StaticBatch([], {}, torch.device("cpu"), 8, 3, 640)
    for size in (1, 4, 8):
        split = decode.view(size).split_decode
        if deterministic:
            assert split is None
        else:
            assert split.max_seq_len == 640 and split.scratch is decode.split_scratch
        assert verify.view(size).split_decode is None


def test_scratch_is_made_once_and_reused():
    scratch = DecodeSplitScratch(max_rows=8)
    q = torch.zeros(8, 4, 16)
    parts, lses = scratch.buffers(5, q)
    assert parts.shape == (5, 8, 4, 16) and lses.shape == (5, 8, 4)
    smaller, smaller_lses = scratch.buffers(5, q[:3])
    assert smaller.shape == (5, 3, 4, 16) and smaller.data_ptr() == parts.data_ptr()
    assert smaller_lses.data_ptr() == lses.data_ptr()
    assert len(scratch._buffers) == 1
    with pytest.raises(ValueError, match="rows"):
        scratch.buffers(5, torch.zeros(9, 4, 16))


def _spy_attention(monkeypatch, run_split_kernel: bool = False) -> list[dict]:
    """Records, per attention call, the step's row kinds and the split decision. With
    run_split_kernel, split calls run the split-KV Triton kernel (interpreted on the CPU)
    through ops' split path, the others the torch reference, as on a GPU they would run
    the split and one-pass kernels."""
    seen = []
    reference = attention_layer.paged_attention

    def spy(q, kv_cache, block_tables, qsl, seq_lens, scale, window, **kw):
        split = kw.pop("split_decode")
        seen.append(dict(split=split, lens=seq_lens.tolist(), tokens=q.shape[0]))
        if split is None or not run_split_kernel:
            return reference(q, kv_cache, block_tables, qsl, seq_lens, scale, window, **kw)
        shard = (kw["kv_stride"], kw["kv_offset"], kw["k_scale"], kw["v_scale"])
        args = (q, kv_cache, block_tables, qsl, seq_lens, scale, window, *shard, split)
        out = ops._paged_attention_decode_split(*args)
        if split.scratch is not None:
            seen[-1]["scratch"] = [t.data_ptr() for p in split.scratch._buffers.values() for t in p]
        return out

    monkeypatch.setattr(attention_layer, "paged_attention", spy)
    return seen


def _record_steps(engine: Engine) -> list[tuple[list[RowKind], object]]:
    """Wraps the model so every forward records its batch's row kinds and decision."""
    model = engine.executor.worker.runner.model
    kinds = []
    forward = model.forward

    def record(input_ids, positions, batch):
        kinds.append((list(batch.rows.kinds), batch.split_decode))
        return forward(input_ids, positions, batch)

    model.forward = record
    return kinds


@pytest.mark.parametrize("deterministic", [False, True])
def test_engine_picks_the_split_path_for_true_decodes_only(tiny_model, monkeypatch, deterministic):
    """Decode steps take the split path, steps with a fresh one-token prompt or a prefill
    chunk do not; in the deterministic mode no step does."""
    engine = Engine(
        model=str(tiny_model("llama")),
        dtype="float32",
        device="cpu",
        max_num_seqs=8,
        deterministic=deterministic,
    )
    seen = _spy_attention(monkeypatch)
    steps = _record_steps(engine)
    run_to_completion(engine, [PROMPTS[3], PROMPTS[5]], greedy(4))
    engine.add_request("a", {"prompt_token_ids": PROMPTS[4]}, greedy(4))
    engine.step()
    engine.add_request("one", {"prompt_token_ids": [PROMPTS[0][0]]}, greedy(2))
    while engine.has_unfinished_requests():
        engine.step()
    layers = len(seen) // len(steps)
    assert layers * len(steps) == len(seen) and layers >= 2
    decisions = [seen[i * layers : (i + 1) * layers] for i in range(len(steps))]
    true_decodes = 0
    for (kinds, split), calls in zip(steps, decisions):
        want = not deterministic and all(k == RESUME for k in kinds)
        true_decodes += all(k == RESUME for k in kinds)
        assert all((c["split"] is not None) == want for c in calls), kinds
        assert all(c["split"] is split for c in calls)  # the layers pass it on
    assert true_decodes >= 3
    assert any(FRESH in kinds and len(kinds) > 1 for kinds, _ in steps)
    assert_pool_full(engine)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernel interpreted on the CPU"
)
@pytest.mark.parametrize(
    ("arch", "window", "merge"),
    [("llama", None, False), ("mistral", 24, False), ("llama", None, True)],
)
def test_split_kernel_in_replayed_graphs_gives_the_reference_tokens(
    tiny_model, monkeypatch, arch, window, merge
):
    """Float32 on the CPU: decode steps replay stand-in graphs and run the split-KV kernel
    (32-key splits for the tiny models' two KV heads, half the patched 64, so rows cross
    several) over the graph's scratch, made once; padding
    rows included. Tokens equal the torch reference engine's. `merge`: the splits merged
    in the attention launch (`split_merge`, forced on here), over the scratch's counters."""
    from kvloom.kernels import paged_attention_triton

    if merge:
        monkeypatch.setattr(paged_attention_triton, "uses_split_merge", lambda q: True)
    overrides = {} if window is None else dict(sliding_window=window)
    path = str(tiny_model(arch, **overrides))
    prompts = [PROMPTS[3], PROMPTS[6], PROMPTS[7]]
    want = run_to_completion(Engine(model=path, dtype="float32", device="cpu"), prompts, greedy(12))
    monkeypatch.setattr(paged_attention_triton, "DECODE_KEYS_PER_SPLIT", 64)
    engine = Engine(model=path, dtype="float32", device="cpu", max_num_seqs=8)
    seen = _spy_attention(monkeypatch, run_split_kernel=True)
    runner = engine.executor.worker.runner
    runner.capture_graphs(EagerStepGraph, capture_sizes(8))
    captured = [c["scratch"] for c in seen if c["split"] is not None]
    seen.clear()
    got = run_to_completion(engine, prompts, greedy(12))
    assert runner.graphs.replays >= 11
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    replayed = [c for c in seen if c["split"] is not None and c["split"].scratch is not None]
    assert replayed and all(c["tokens"] == 4 for c in replayed)  # 3 rows + 1 padding row
    assert max(max(c["lens"]) for c in replayed) > 32  # rows cross a split boundary
    # One scratch, made at the first (largest) capture and never remade.
    assert captured and all(len(c) == 2 for c in captured)  # (parts, lses), one shape
    assert len({tuple(c) for c in captured + [c["scratch"] for c in replayed]}) == 1
    counters = list(replayed[0]["split"].scratch._counters.values())
    assert len(counters) == int(merge) and not any(c.any() for c in counters)
    assert_pool_full(engine)


def test_split_size_variable_reaches_the_kernel(monkeypatch):
    """KVLOOM_DECODE_KEYS_PER_SPLIT sets the split decode's split size (A/B timing); unset,
    the kernel's constant; anything but a positive multiple of 16 is an error naming it."""
    from types import SimpleNamespace

    from kvloom.kernels import paged_attention_triton

    got = []
    monkeypatch.setattr(
        paged_attention_triton,
        "paged_attention_decode_split_triton",
        lambda *args, **kw: got.append(kw["keys_per_split"]),
    )
    split = SimpleNamespace(scratch=None, max_seq_len=64)
    q = torch.zeros(1, 8, 8)

    def call(kv_heads):  # kv_cache [2, blocks, block_size, kv_heads, dim]
        cache = torch.zeros(2, 1, 16, kv_heads, 8)
        return ops._paged_attention_decode_split(
            q, cache, None, None, None, 1.0, None, 1, 0, None, None, split
        )

    monkeypatch.delenv("KVLOOM_DECODE_KEYS_PER_SPLIT", raising=False)
    for kv_heads in (8, 4, 2, 1):
        call(kv_heads)
    constant = paged_attention_triton.DECODE_KEYS_PER_SPLIT
    # Half the split at two KV heads or fewer (a short row's programs), whatever the batch.
    assert got == [constant, constant, constant // 2, constant // 2]
    monkeypatch.setenv("KVLOOM_DECODE_KEYS_PER_SPLIT", "64")
    got.clear()
    call(8)
    call(2)
    assert got == [64, 64]
    for bad in ("0", "-64", "40", "many"):
        monkeypatch.setenv("KVLOOM_DECODE_KEYS_PER_SPLIT", bad)
        with pytest.raises(ValueError, match="KVLOOM_DECODE_KEYS_PER_SPLIT"):
            call(2)
