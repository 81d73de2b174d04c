"""CUDA-graph dispatch (invariant 3), decode-only batches and the profiling run.

The dispatch rule and the decode-only flag are host logic and are tested here on CPU;
capture, replay and memory sizing need CUDA (tests marked `gpu`, run on the H200).
"""

from __future__ import annotations

import logging

import pytest
import torch
from engine_helpers import PROMPTS, assert_pool_full, greedy, run_to_completion

from kvloom import Engine, SamplingParams
from kvloom.workers.cuda_graphs import TargetGraphs, capture_sizes, graph_size_for
from kvloom.workers.graph_capture import EagerStepGraph
from kvloom.workers.memory_profile import largest_step_shape, run_largest_step
from kvloom.workers.row_kinds import RowClasses, RowKind

FRESH, RESUME, PADDING = RowKind.FRESH, RowKind.RESUME, RowKind.PADDING
SIZES = capture_sizes(16)


def test_capture_ladder():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    big = capture_sizes(1024)
    assert big[:5] == [1, 2, 4, 8, 16] and 256 in big and 264 not in big
    assert big[-3:] == [960, 992, 1024] and len(big) == 3 + 32 + 24
    assert capture_sizes(300)[-3:] == [256, 288, 300]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[-3:] == [240, 248, 256]


@pytest.mark.parametrize(
    "kinds, scheduled, want",
    [
        ([RESUME], [1], 1),
        ([RESUME] * 3, [1] * 3, 4),
        ([RESUME] * 16, [1] * 16, 16),
        # A brand-new one-token prompt has the decode shape, not the decode meaning.
        ([RESUME, FRESH, RESUME], [1, 1, 1], None),
        ([FRESH], [1], None),
        ([RESUME, RESUME], [1, 5], None),  # a prefill chunk resuming
        ([RESUME, PADDING], [1, 0], None),
        ([RESUME] * 17, [1] * 17, None),  # past the largest graph
        ([], [], None),
    ],
)
def test_graph_dispatch_follows_the_row_classification(kinds, scheduled, want):
    rows = RowClasses(kinds, scheduled)
    assert graph_size_for(rows, sum(scheduled), SIZES) == want


def test_graph_dispatch_needs_one_token_per_row():
    # Two speculative tokens per row: the token count is not the row count.
    assert graph_size_for(RowClasses([RESUME] * 2, [3, 3]), 6, SIZES) is None


def _record_decode_only(engine: Engine) -> list[tuple[bool, list]]:
    """Wraps the model so every forward records (batch.decode_only, row kinds)."""
    model = engine.executor.worker.runner.model
    seen = []
    forward = model.forward

    def spy(input_ids, positions, batch):
        seen.append((batch.decode_only, list(batch.rows.kinds)))
        return forward(input_ids, positions, batch)

    model.forward = spy
    return seen


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_decode_only_batches_are_exactly_the_true_decodes(tiny_model, hybrid_model, arch):
    path = tiny_model("llama") if arch == "llama" else hybrid_model("qwen3_next")
    engine = Engine(model=str(path), dtype="float32", max_num_seqs=8, device="cpu")
    seen = _record_decode_only(engine)
    first = run_to_completion(engine, [PROMPTS[3]], greedy(4))
    # A one-token fresh prompt joins running decodes: that step is not decode-only.
    engine.add_request("a", {"prompt_token_ids": PROMPTS[4]}, greedy(6))
    engine.step()
    engine.add_request("b", {"prompt_token_ids": [PROMPTS[0][0]]}, greedy(3))
    while engine.has_unfinished_requests():
        engine.step()
    assert first[0].outputs[0].token_ids
    assert any(flag for flag, _ in seen)
    for flag, kinds in seen:
        assert flag == all(k == RESUME for k in kinds), (flag, kinds)
    mixed = [kinds for flag, kinds in seen if FRESH in kinds and len(kinds) > 1]
    assert mixed, "the fresh one-token prompt never shared a step with a decode"
    assert_pool_full(engine)


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_decode_only_path_gives_the_same_tokens(tiny_model, hybrid_model, arch):
    """The decode-only code path (the one graphs capture) against steps that carry a
    prefill chunk beside every decode (so no step is decode-only), float64 on CPU."""
    path = tiny_model("llama") if arch == "llama" else hybrid_model("qwen3_next")
    prompts = PROMPTS[:4]
    engine = Engine(model=str(path), dtype="float64", max_num_seqs=8, device="cpu")
    seen = _record_decode_only(engine)
    alone = run_to_completion(engine, prompts, greedy(10))
    assert any(flag for flag, _ in seen)
    # No prefix caching: a repeated filler would hit all but its last token (a hybrid's
    # prompt checkpoint too) and its one-token chunk would make the step decode-shaped.
    engine = Engine(
        model=str(path),
        dtype="float64",
        max_num_seqs=8,
        max_num_batched_tokens=32,
        device="cpu",
        enable_prefix_caching=False,
    )
    seen = _record_decode_only(engine)
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": prompt}, greedy(10))
    done, filler = {}, 0
    while not all(rid in done for rid in ids):
        # A long prompt always in flight: its chunks ride along with every decode.
        engine.add_request(f"f{filler}", {"prompt_token_ids": PROMPTS[7] * 2}, greedy(1))
        filler += 1
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert not any(flag for flag, _ in seen)
    for want, rid in zip(alone, ids):
        assert done[rid].outputs[0].token_ids == want.outputs[0].token_ids
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_full(engine)


def _stand_in_graphs(engine: Engine) -> TargetGraphs:
    """Decode graphs whose replays run the forward eagerly over the same static buffers a
    real graph reads (EagerStepGraph), so the replay plumbing (copies into the buffers,
    padding rows, state indices) is tested without CUDA."""
    runner = engine.executor.worker.runner
    runner.capture_graphs(EagerStepGraph, capture_sizes(8))
    return runner.graphs


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_replay_plumbing_with_padding_rows(tiny_model, hybrid_model, arch):
    """Three decodes replay the 4-row graph (one padding row: no write slot, state -1) and
    give the tokens of the plain eager path, float64, with prefix caching on."""
    path = tiny_model("llama") if arch == "llama" else hybrid_model("qwen3_next")
    prompts = PROMPTS[2:5]
    want = run_to_completion(
        Engine(model=str(path), dtype="float64", device="cpu"), prompts, greedy(12)
    )
    engine = Engine(model=str(path), dtype="float64", device="cpu", max_num_seqs=8)
    graphs = _stand_in_graphs(engine)
    got = run_to_completion(engine, prompts, greedy(12))
    assert graphs.replays >= 11
    for w, g in zip(want, got):
        assert g.outputs[0].finish_reason == "length"
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    # A fresh one-token prompt beside running decodes is not replayed.
    engine.add_request("a", {"prompt_token_ids": PROMPTS[4]}, greedy(4))
    engine.step()
    before = graphs.replays
    engine.add_request("one", {"prompt_token_ids": [PROMPTS[0][0]]}, greedy(2))
    engine.step()
    assert graphs.replays == before
    engine.step()
    assert graphs.replays == before + 1
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_full(engine)


def test_profiling_step_leaves_nothing_behind(tiny_model):
    engine = Engine(
        model=str(tiny_model("llama")),
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        device="cpu",
    )
    runner = engine.executor.worker.runner
    assert largest_step_shape(engine.config.scheduler) == (64, 4)
    run_largest_step(runner, 64, 4)
    assert not runner.input_batch.requests
    assert all(layer.kv_cache is None for layer, _ in runner.cache_layers())
    runner.initialize_kv_cache(engine.stats()["num_blocks"])
    outs = run_to_completion(engine, PROMPTS[:2], greedy(3))
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)


def test_graph_memory_over_the_margin_is_a_warning(caplog):
    """Capture's memory is measured against the margin the KV pool left for it: within it a
    log line, beyond it a warning naming what to lower."""
    from kvloom.workers.memory_profile import CUDA_GRAPH_MARGIN, MiB, report_graph_memory

    with caplog.at_level(logging.INFO, logger="kvloom.workers.memory_profile"):
        report_graph_memory(300 * MiB)
        report_graph_memory(CUDA_GRAPH_MARGIN + 64 * MiB)
    info, warning = caplog.records
    assert info.levelno == logging.INFO and "300 MiB of the 512 MiB margin" in info.message
    assert warning.levelno == logging.WARNING and "576 MiB" in warning.message
    assert "gpu_memory_utilization" in warning.message


def test_graph_margin_grows_with_speculation():
    """Speculation's verification, proposal and catch-up graphs get the larger margin (they
    took 622-772 MiB on an H200 against the plain margin's 512); no graphs, no margin."""
    from kvloom.workers.memory_profile import (
        CUDA_GRAPH_MARGIN,
        SPECULATIVE_GRAPH_MARGIN,
        graph_margin,
    )

    assert SPECULATIVE_GRAPH_MARGIN > CUDA_GRAPH_MARGIN
    assert graph_margin(True, False) == CUDA_GRAPH_MARGIN
    assert graph_margin(True, True) == SPECULATIVE_GRAPH_MARGIN
    assert graph_margin(False, True) == graph_margin(False, False) == 0


# -- on the GPU ----------------------------------------------------------------------------

GPU_ARCHS = ["llama", "qwen3", "qwen3_next", "kimi_linear"]
HYBRIDS = ("qwen3_next", "kimi_linear")


def _gpu_engine(path, **kwargs):
    return Engine(model=str(path), dtype="float32", device="cuda", max_num_seqs=16, **kwargs)


def _model_path(tiny_model, hybrid_model, arch):
    return hybrid_model(arch) if arch in HYBRIDS else tiny_model(arch)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", GPU_ARCHS)
def test_gpu_graphs_match_the_cpu_reference(tiny_model, hybrid_model, arch):
    path = _model_path(tiny_model, hybrid_model, arch)
    cpu = Engine(model=str(path), dtype="float32", device="cpu", max_num_seqs=16)
    want = run_to_completion(cpu, PROMPTS, greedy(24))
    gpu = _gpu_engine(path)
    graphs = gpu.executor.worker.runner.graphs
    assert graphs is not None and graphs.sizes[-1] == 16
    got = run_to_completion(gpu, PROMPTS, greedy(24))
    assert all(o.outputs[0].finish_reason == "length" for o in got), got[0].outputs[0]
    assert graphs.replays > 0
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, (arch, w.prompt_token_ids)
    assert_pool_full(gpu)
    eager = _gpu_engine(path, enforce_eager=True)
    assert eager.executor.worker.runner.graphs is None
    again = run_to_completion(eager, PROMPTS, greedy(24))
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in got]


@pytest.mark.gpu
@pytest.mark.parametrize("arch", GPU_ARCHS)
def test_gpu_pdl_gives_the_same_tokens(tiny_model, hybrid_model, arch, monkeypatch):
    """Programmatic dependent launch (KVLOOM_FUSED=pdl, kernels/pdl_triton.py) changes when
    the decode kernels start, never what they compute: in bfloat16, where the Triton
    decode kernels run, the same greedy tokens with and without it, from CUDA graphs."""
    path = _model_path(tiny_model, hybrid_model, arch)
    monkeypatch.delenv("KVLOOM_FUSED", raising=False)
    monkeypatch.delenv("KVLOOM_UNFUSED", raising=False)
    want = _graph_tokens(path)
    monkeypatch.setenv("KVLOOM_FUSED", "pdl")
    for release in ("start", "loop", "exit"):  # where each kernel lets the next one stage
        monkeypatch.setenv("KVLOOM_PDL_RELEASE", release)
        assert _graph_tokens(path) == want, release


def _graph_tokens(path) -> list[list[int]]:
    """Greedy tokens of PROMPTS in bfloat16 from CUDA graphs (the decode kernels' path)."""
    engine = Engine(model=str(path), dtype="bfloat16", device="cuda", max_num_seqs=16)
    outputs = run_to_completion(engine, PROMPTS, greedy(24))
    assert engine.executor.worker.runner.graphs.replays > 0
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.gpu
@pytest.mark.parametrize("arch", GPU_ARCHS)
def test_gpu_split_merge_gives_the_same_tokens(tiny_model, hybrid_model, arch, monkeypatch):
    """The split-KV decode merging in its attention launch (KVLOOM_FUSED=split_merge) gives
    the merge launch's bits, so the same greedy tokens from CUDA graphs in bfloat16."""
    path = _model_path(tiny_model, hybrid_model, arch)
    monkeypatch.delenv("KVLOOM_FUSED", raising=False)
    monkeypatch.delenv("KVLOOM_UNFUSED", raising=False)
    want = _graph_tokens(path)
    monkeypatch.setenv("KVLOOM_FUSED", "split_merge")
    assert _graph_tokens(path) == want


@pytest.mark.gpu
@pytest.mark.parametrize("arch", HYBRIDS)
def test_gpu_moe_slot_sum_gives_the_same_tokens(tiny_model, hybrid_model, arch, monkeypatch):
    """The fused MoE's decode plan summing slots in its down launch (the default) gives
    the slot-sum launch's bits (KVLOOM_UNFUSED=moe_slot_sum), so the same greedy tokens
    from CUDA graphs in bfloat16 (both hybrids have mixture-of-experts layers)."""
    path = _model_path(tiny_model, hybrid_model, arch)
    monkeypatch.delenv("KVLOOM_FUSED", raising=False)
    monkeypatch.setenv("KVLOOM_UNFUSED", "moe_slot_sum")
    want = _graph_tokens(path)
    monkeypatch.delenv("KVLOOM_UNFUSED")
    assert _graph_tokens(path) == want


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_gpu_fresh_one_token_chunk_is_not_replayed(tiny_model, hybrid_model, arch):
    path = _model_path(tiny_model, hybrid_model, arch)
    gpu = _gpu_engine(path)
    graphs = gpu.executor.worker.runner.graphs
    prompts = {f"d{i}": p for i, p in enumerate(PROMPTS[2:5])}
    for rid, prompt in prompts.items():
        gpu.add_request(rid, {"prompt_token_ids": prompt}, greedy(8))
    done = {}

    def step():
        for out in gpu.step():
            if out.finished:
                done[out.request_id] = out

    step()  # the three prefills
    before = graphs.replays
    step()  # three decodes
    assert graphs.replays == before + 1
    prompts["one"] = [PROMPTS[0][0]]
    gpu.add_request("one", {"prompt_token_ids": prompts["one"]}, greedy(8))
    step()  # three decodes + a fresh one-token prompt: eager
    assert graphs.replays == before + 1
    step()  # four true decodes again
    assert graphs.replays == before + 2
    while gpu.has_unfinished_requests():
        step()
    cpu = Engine(model=str(path), dtype="float32", device="cpu")
    want = run_to_completion(cpu, list(prompts.values()), greedy(8))
    for rid, w in zip(prompts, want):
        assert done[rid].outputs[0].token_ids == w.outputs[0].token_ids, rid
    assert_pool_full(gpu)


@pytest.mark.gpu
def test_gpu_kv_cache_is_sized_by_a_profiling_run(tiny_model):
    path = tiny_model("llama")
    engine = _gpu_engine(path, max_num_batched_tokens=2048, gpu_memory_utilization=0.5)
    free, total = torch.cuda.mem_get_info()
    pool_bytes = engine.stats()["num_blocks"] * engine.executor.worker.runner.bytes_per_block()
    assert engine.stats()["num_blocks"] >= 2
    assert torch.cuda.memory_allocated() <= 0.5 * total + 2**30
    assert pool_bytes > 0
    with pytest.raises(ValueError, match="does not fit"):
        _gpu_engine(path, gpu_memory_utilization=1e-6, enforce_eager=True)


@pytest.mark.gpu
def test_gpu_seeded_sampling_is_graph_independent(tiny_model):
    path = tiny_model("llama")
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    runs = []
    for eager in (False, True):
        engine = _gpu_engine(path, enforce_eager=eager)
        runs.append([o.outputs[0].token_ids for o in run_to_completion(engine, PROMPTS, params)])
    assert runs[0] == runs[1]
