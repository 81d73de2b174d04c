"""CUDA graphs for speculative verification steps, keyed by (rows, k), and for drafters'
proposal positions (workers/cuda_graphs.py, workers/spec_decode/proposal_graphs.py).

The dispatch decision is host logic (`graph_key_for`) and is tested case by case. Replay
runs on CPU through `EagerStepGraph`: each replay reruns the forward over the static
buffers a captured graph reads, and its outputs are static buffers that the next replay
overwrites. So padding rows, the hybrid's scratch state, drafter states copied out of
graph outputs and hooked auxiliary states all run here; float64 tokens must equal plain
decoding, and drafts must equal those of the eager speculative engine. Real capture on
CUDA: the `gpu` tests at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from kvloom import Engine, SamplingParams
from kvloom.workers.cuda_graphs import capture_sizes, graph_key_for, verify_graph_size_for
from kvloom.workers.graph_capture import EagerStepGraph
from kvloom.workers.row_kinds import RowClasses, RowKind
from tests.engine_helpers import assert_pool_full, greedy, multi_turn, run_to_completion
from tests.test_spec_decode_engine import draft_config, engine, repetitive_prompts

FRESH, RESUME, PADDING = RowKind.FRESH, RowKind.RESUME, RowKind.PADDING
K = 3
SIZES = capture_sizes(16)  # 1, 2, 4, 8, 16
V = K + 1  # a verification row's tokens


@pytest.mark.parametrize(
    "kinds, scheduled, drafts, want",
    [
        ([RESUME] * 3, [V] * 3, [K] * 3, (4, K)),
        # The ladder's edges: exact sizes, the next size up, past the largest.
        ([RESUME], [V], [K], (1, K)),
        ([RESUME] * 8, [V] * 8, [K] * 8, (8, K)),
        ([RESUME] * 9, [V] * 9, [K] * 9, (16, K)),
        ([RESUME] * 16, [V] * 16, [K] * 16, (16, K)),
        ([RESUME] * 17, [V] * 17, [K] * 17, None),
        # A fresh one-token chunk batched with verifications.
        ([RESUME, RESUME, FRESH], [V, V, 1], [K, K, 0], None),
        # A chunked prefill's final chunk of k + 1 tokens batched with verifications: a
        # resume row of exactly the verification shape, but it verifies no drafts.
        ([RESUME, RESUME, RESUME], [V, V, V], [K, K, 0], None),
        ([RESUME], [V], [0], None),
        # A fresh first chunk of k + 1 tokens.
        ([RESUME, FRESH], [V, V], [K, 0], None),
        # Padding rows in the step itself.
        ([RESUME, PADDING, RESUME], [V, 0, V], [K, 0, K], None),
        # Mixed k: a row with fewer drafts; every row with k - 1 (no such graph).
        ([RESUME, RESUME], [V, V - 1], [K, K - 1], None),
        ([RESUME, RESUME], [V - 1, V - 1], [K - 1, K - 1], None),
        # Plain one-token decodes without drafts take the decode graph...
        ([RESUME] * 3, [1] * 3, [0] * 3, (4, 0)),
        ([RESUME, FRESH], [1, 1], [0, 0], None),
        # ...but not beside verifications.
        ([RESUME, RESUME], [V, 1], [K, 0], None),
        ([], [], [], None),
    ],
)
def test_dispatch_follows_the_row_classification_and_the_drafts(kinds, scheduled, drafts, want):
    rows = RowClasses(kinds, scheduled)
    assert graph_key_for(rows, drafts, sum(scheduled), SIZES, K) == want


def test_dispatch_needs_the_verification_token_count_and_speculation():
    rows = RowClasses([RESUME] * 2, [V, V])
    assert verify_graph_size_for(rows, [K, K], K, 2 * V, SIZES) == 2
    assert verify_graph_size_for(rows, [K, K], K, 2 * V - 1, SIZES) is None
    assert verify_graph_size_for(rows, [K], K, 2 * V, SIZES) is None
    assert graph_key_for(rows, [K, K], 2 * V, SIZES, 0) is None  # no speculation
    assert verify_graph_size_for(rows, [K, K], K, 2 * V, []) is None


# -- the graph path on CPU (EagerStepGraph) -------------------------------------------


@dataclass
class Step:
    kinds: list
    lens: list[int]
    drafts: list[int]
    verify_replayed: bool
    decode_replayed: bool


LADDER = [4, 8]  # steps of fewer than 4 rows (most here) run padded


def graph_engine(path, **kw) -> Engine:
    """A float64 CPU engine whose runner captured stand-in graphs of LADDER rows."""
    eng = engine(path, device="cpu", **kw)
    eng.executor.worker.runner.capture_graphs(EagerStepGraph, LADDER)
    return eng


def record_dispatch(eng: Engine) -> list[Step]:
    """Per target forward: the rows, their drafts, and which graph (if any) served it."""
    runner = eng.executor.worker.runner
    seen: list[Step] = []
    forward = runner._forward

    def spy(input_ids, batch):
        verify = runner.verify_graphs.replays if runner.verify_graphs else 0
        decode = runner.graphs.replays
        out = forward(input_ids, batch)
        seen.append(
            Step(
                list(batch.rows.kinds),
                list(batch.rows.num_scheduled_tokens),
                list(runner.step_row_drafts),
                (runner.verify_graphs.replays if runner.verify_graphs else 0) > verify,
                runner.graphs.replays > decode,
            )
        )
        return out

    runner._forward = spy
    return seen


def check_dispatch(seen: list[Step], most: int = 8, verify_graphs: bool = True) -> None:
    """Exactly the steps whose every row is a true decode verifying k drafts replayed a
    verification graph (none where there are no verification graphs); exactly the
    draft-free one-token decodes a decode graph."""
    for step in seen:
        fits = 0 < len(step.kinds) <= most and all(k == RESUME for k in step.kinds)
        verify = fits and all(n == V for n in step.lens) and all(d == K for d in step.drafts)
        verify = verify and verify_graphs
        decode = fits and all(n == 1 for n in step.lens) and not any(step.drafts)
        assert step.verify_replayed == verify, step
        assert step.decode_replayed == decode, step


def record_drafts(eng: Engine) -> list[dict]:
    """What the drafter proposes, step by step (n-gram: what the runner proposes)."""
    runner = eng.executor.worker.runner
    seen: list[dict] = []
    carry = runner._carry_over

    def spy(out):
        seen.append({rid: list(d) for rid, d in out.spec_token_ids.items()})
        return carry(out)

    runner._carry_over = spy
    return seen


def spec_config(method: str, target, tiny_model, tmp_path) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3}
    if method == "draft_model":
        return draft_config(tiny_model("qwen2"), K)  # an unrelated draft: some rejections
    if method == "self_draft":
        return draft_config(target, K)  # the target drafting for itself: all accepted
    if method == "eagle":
        from kvloom.workers.spec_decode.eagle import write_eagle_head

        head = write_eagle_head(tmp_path / "head", target)
        return {"method": "eagle", "model": str(head), "num_speculative_tokens": K}
    if method == "eagle3":
        from kvloom.workers.spec_decode.eagle3 import write_eagle3_head

        head = write_eagle3_head(tmp_path / "head3", target, aux_layer_ids=[0, 1, 2])
        return {"method": "eagle3", "model": str(head), "num_speculative_tokens": K}
    raise AssertionError(method)


@pytest.fixture(scope="module", params=["dense", "qwen3_next", "kimi_linear"])
def target(request, tiny_model, hybrid_model):
    return tiny_model("qwen3") if request.param == "dense" else hybrid_model(request.param)


def workload(eng: Engine):
    """Chunked prefill and preemption under a small pool and token budget, then prefix hits
    across turns."""
    outs = run_to_completion(eng, repetitive_prompts(), greedy(24))
    turns = multi_turn(eng, num_conversations=2, num_turns=3, max_tokens=8)
    return [o.outputs[0].token_ids for o in outs], [
        [o.outputs[0].token_ids for _, o in t] for t in turns
    ]


def setting(target) -> dict:
    """A pool small enough to preempt and large enough to keep prefix hits: Kimi-Linear's
    MLA pages hold fewer tokens per page of the one pool, so it gets more pages."""
    blocks = 56 if "kimi_linear" in str(target) else 40
    return dict(num_kv_blocks=blocks, max_num_batched_tokens=16, enable_prefix_caching=True)


# Kimi-Linear (KDA + MLA) runs the drafters that fill k drafts on every row: n-gram lookup
# on its tiny random model never does for a whole step, so no step would fit a graph.
GRAPH_CASES = [(t, m) for t in ("dense", "qwen3_next") for m in ("ngram", "draft_model", "eagle")]
GRAPH_CASES += [("kimi_linear", "draft_model"), ("kimi_linear", "eagle")]


@pytest.mark.parametrize(("arch", "method"), GRAPH_CASES)
def test_verification_graphs_give_the_eager_tokens_and_drafts(
    arch, method, tiny_model, hybrid_model, tmp_path
):
    target = tiny_model("qwen3") if arch == "dense" else hybrid_model(arch)
    spec = spec_config(method, target, tiny_model, tmp_path)
    settings = setting(target)
    plain = workload(engine(target, **settings))
    eager = engine(target, speculative_config=spec, device="cpu", **settings)
    eager_drafts = record_drafts(eager)
    assert workload(eager) == plain
    eng = graph_engine(target, speculative_config=spec, **settings)
    runner = eng.executor.worker.runner
    seen, drafts = record_dispatch(eng), record_drafts(eng)
    assert workload(eng) == plain
    assert drafts == eager_drafts  # drafter states survive the static outputs
    check_dispatch(seen)
    stats = eng.stats()
    assert runner.verify_graphs.replays > 0
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert stats["spec_drafted_tokens"] > 0
    # Padding rows ran in verification graphs (a row count off the ladder).
    assert any(s.verify_replayed and len(s.kinds) not in LADDER for s in seen)
    if arch != "dense":
        assert runner.scratch_state is not None
    if method != "ngram":
        assert runner.draft.graphs.replays > 0
    if method == "draft_model":  # a dense draft also catches up in (rows, k + 1) graphs
        assert runner.draft.catch_up_graphs.replays > 0
    assert_pool_full(eng)


def test_fresh_and_final_prefill_chunks_never_replay_a_verification_graph(tiny_model):
    """A dense target drafting for itself (every row verifies k drafts): a fresh
    one-token prompt and a prompt whose final chunk is k + 1 tokens join running
    verifications; those steps run eagerly, the others replay."""
    path = tiny_model("qwen3")
    spec = draft_config(path, K)
    eng = graph_engine(path, speculative_config=spec, max_num_batched_tokens=16)
    seen = record_dispatch(eng)
    runner = eng.executor.worker.runner
    prompts = {"a": repetitive_prompts(2)[0], "b": repetitive_prompts(2)[1]}
    for rid, prompt in prompts.items():
        eng.add_request(rid, {"prompt_token_ids": prompt}, greedy(40))
    done = {}

    def step():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out

    while not runner.verify_graphs.replays:
        step()
    # Two verifying rows take 2 (k + 1) = 8 of the 16-token budget: a 12-token prompt
    # runs as a fresh 8-token chunk, then a final chunk of 4 = k + 1 tokens.
    prompts["chunked"] = [7 + i for i in range(12)]
    eng.add_request("chunked", {"prompt_token_ids": prompts["chunked"]}, greedy(4))
    step()
    step()
    prompts["one"] = [9]
    eng.add_request("one", {"prompt_token_ids": prompts["one"]}, greedy(4))
    step()
    while eng.has_unfinished_requests():
        step()
    check_dispatch(seen)
    final_chunk = [
        s
        for s in seen
        if len(s.kinds) == 3 and all(k == RESUME for k in s.kinds) and s.lens == [V, V, V]
    ]
    assert final_chunk and final_chunk[0].drafts == [K, K, 0]
    assert not final_chunk[0].verify_replayed
    fresh_one = [
        s
        for s in seen
        if FRESH in s.kinds and 1 in [n for k, n in zip(s.kinds, s.lens) if k == FRESH]
    ]
    assert fresh_one and not any(s.verify_replayed for s in fresh_one)
    assert any(s.verify_replayed for s in seen[seen.index(fresh_one[-1]) + 1 :])
    want = run_to_completion(
        engine(path), list(prompts.values()), [greedy(40), greedy(40), greedy(4), greedy(4)]
    )
    for rid, w in zip(prompts, want):
        assert done[rid].outputs[0].token_ids == w.outputs[0].token_ids, rid
    assert_pool_full(eng)


@pytest.mark.parametrize("method", ["ngram", "self_draft"])
def test_async_scheduling_with_verification_graphs(target, method, tiny_model, tmp_path):
    """The step scheduled ahead verifies the drafts the worker filled into placeholder
    slots; where it had fewer, the rows are shorter and the step runs eagerly (n-gram
    lookup here rarely finds k drafts for every row at once: its steps mostly do)."""
    spec = spec_config(method, target, tiny_model, tmp_path)
    params = [
        greedy(20),
        SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=7, ignore_eos=True),
        greedy(18),
        SamplingParams(max_tokens=14, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
    ]
    prompts = repetitive_prompts(4)
    want = run_to_completion(engine(target, speculative_config=spec, device="cpu"), prompts, params)
    eng = graph_engine(target, speculative_config=spec, async_scheduling=True)
    assert eng.async_scheduling
    seen = record_dispatch(eng)
    got = run_to_completion(eng, prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    check_dispatch(seen)
    if method == "self_draft":
        assert eng.executor.worker.runner.verify_graphs.replays > 0
    assert_pool_full(eng)


def test_eagle3_reads_hooked_states_through_target_graphs(tiny_model, tmp_path):
    """EAGLE-3 reads auxiliary hidden states through forward hooks, which a replay does not
    run: the graph hands its static copies over instead, and drafts stay the eager ones."""
    path = tiny_model("qwen3")
    spec = spec_config("eagle3", path, tiny_model, tmp_path)
    eager = engine(path, speculative_config=spec, device="cpu")
    eager_drafts = record_drafts(eager)
    want = run_to_completion(eager, repetitive_prompts(4), greedy(20))
    eng = graph_engine(path, speculative_config=spec)
    drafts = record_drafts(eng)
    got = run_to_completion(eng, repetitive_prompts(4), greedy(20))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert drafts == eager_drafts
    runner = eng.executor.worker.runner
    assert runner.verify_graphs.replays > 0 and runner.draft.graphs.replays > 0
    assert runner.draft.catch_up_graphs.replays > 0  # its catch-up too, every entry
    assert eng.stats()["spec_accepted_tokens"] < eng.stats()["spec_drafted_tokens"]


def test_dflash_proposals_stay_eager_and_say_why(tiny_model, tmp_path, caplog):
    from kvloom.workers.spec_decode.dflash import write_dflash_head

    path = tiny_model("qwen3")
    head = write_dflash_head(tmp_path / "dflash", path)
    spec = {"method": "dflash", "model": str(head), "num_speculative_tokens": K}
    want = run_to_completion(engine(path), repetitive_prompts(3), greedy(16))
    with caplog.at_level("INFO", logger="kvloom.workers.model_runner"):
        eng = graph_engine(path, speculative_config=spec)
    runner = eng.executor.worker.runner
    assert "dflash" in " ".join(runner.drafter_graph_blockers())
    assert "drafter forwards run eagerly: dflash" in caplog.text
    got = run_to_completion(eng, repetitive_prompts(3), greedy(16))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert runner.verify_graphs.replays > 0 and getattr(runner.draft, "graphs", None) is None


def test_graph_blockers_with_speculation(tiny_model, monkeypatch):
    """A local drafter no longer keeps the target's graphs off; DCP without the multi-rank
    switch and a remote drafter do, each named."""
    path = tiny_model("qwen3")
    eng = engine(path, speculative_config=draft_config(path, K), device="cpu")
    runner = eng.executor.worker.runner
    assert runner.graph_blockers() == ["not a CUDA device"]
    assert runner.drafter_graph_blockers() == []
    monkeypatch.setenv("KVLOOM_MULTI_RANK_CUDA_GRAPHS", "1")
    runner.dcp = SimpleNamespace(world_size=2)
    assert runner.graph_blockers() == ["not a CUDA device"]  # a shard's kernel is Triton
    monkeypatch.setenv("KVLOOM_MULTI_RANK_CUDA_GRAPHS", "")
    assert "not verified graph-safe" in " | ".join(runner.graph_blockers())
    runner.dcp = None
    monkeypatch.setattr(
        runner,
        "config",
        SimpleNamespace(
            model=runner.config.model,
            speculative=SimpleNamespace(
                placement="remote", method="eagle3", enabled=True, num_speculative_tokens=K
            ),
        ),
    )
    assert "a remote drafter" in " | ".join(runner.graph_blockers())
    runner.draft = object()
    assert runner.drafter_graph_blockers() == ["eagle3: the drafter runs in its own actor"]


# -- on the GPU ----------------------------------------------------------------------------


def _gpu(path, **kw) -> Engine:
    return Engine(model=str(path), dtype="float32", device="cuda", max_num_seqs=16, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "kimi_linear"])
def test_gpu_verification_graphs_match_eager(tiny_model, hybrid_model, tmp_path, arch, method):
    """Captured (rows, k) graphs and drafter graphs, async scheduling on, against the same
    engine with enforce_eager; the dispatch invariant holds on every step."""
    path = hybrid_model(arch) if arch != "llama" else tiny_model(arch)
    if method == "draft_model":
        spec = draft_config(path, K)  # the target drafting for itself: long verifications
    else:
        spec = spec_config(method, path, tiny_model, tmp_path)
    prompts = repetitive_prompts()
    params = [greedy(32), SamplingParams(max_tokens=24, temperature=0.8, seed=3)] * 3
    eager = _gpu(path, speculative_config=spec, enforce_eager=True)
    assert eager.executor.worker.runner.graphs is None
    want = run_to_completion(eager, prompts, params)
    eng = _gpu(path, speculative_config=spec)
    assert eng.async_scheduling
    runner = eng.executor.worker.runner
    assert runner.graphs is not None
    # Hybrids too: their linear layers serve (k + 1)-token rows token by token.
    assert runner.verify_graphs is not None and runner.verify_graph_blockers() == []
    seen = record_dispatch(eng)
    got = run_to_completion(eng, prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    check_dispatch(seen, most=16, verify_graphs=runner.verify_graphs is not None)
    if method != "ngram":  # n-gram rows rarely all hold k drafts: replays depend on text
        if runner.verify_graphs is not None:
            assert runner.verify_graphs.replays > 0
        assert runner.draft.graphs.replays > 0
    if method == "draft_model":  # catch-up graphs only where the draft has no linear state
        catch_up = runner.draft.catch_up_graphs
        assert (catch_up is None) == (arch != "llama")
        assert catch_up is None or catch_up.replays > 0
    assert_pool_full(eng)


def test_hybrid_verification_graph_blockers_on_cuda(tiny_model, hybrid_model, monkeypatch):
    """On CUDA a hybrid target captures verification graphs (its Gated DeltaNet or KDA
    layers serve uniform resume rows token by token, no host bounds); a linear layer
    without that path keeps them off."""
    cuda = SimpleNamespace(type="cuda")
    spec = {"method": "ngram", "num_speculative_tokens": K}
    for path in (tiny_model("qwen3"), hybrid_model("qwen3_next"), hybrid_model("kimi_linear")):
        runner = engine(path, speculative_config=spec, device="cpu").executor.worker.runner
        assert runner.verify_graph_blockers() == []  # the CPU stand-in runs every case
        runner.device = cuda
        assert runner.verify_graph_blockers() == []
        if runner._linear_layers():
            layer = runner._linear_layers()[0]
            monkeypatch.setattr(type(layer), "captures_uniform_resume", False)
            name = type(layer).__name__
            assert f"{name} layers" in " | ".join(runner.verify_graph_blockers())
            monkeypatch.undo()


def test_uniform_resume_rows_are_recognised_from_the_one_classification():
    from kvloom.workers.layers.linear_state_pages import uniform_resume_len
    from kvloom.workers.row_kinds import RowClasses, classify_rows

    def batch(computed, scheduled):
        return SimpleNamespace(rows=RowClasses(classify_rows(computed, scheduled), scheduled))

    assert uniform_resume_len(batch([7, 9], [5, 5]), 10) == 5  # a (2, 4) verification
    assert uniform_resume_len(batch([7, 0], [5, 5]), 10) is None  # a fresh row
    assert uniform_resume_len(batch([7, 9], [5, 4]), 9) is None  # uneven rows
    assert uniform_resume_len(batch([7, 9], [1, 1]), 2) is None  # decodes: their own path
    assert uniform_resume_len(batch([7], [16]), 16) is None  # a long resume chunk
