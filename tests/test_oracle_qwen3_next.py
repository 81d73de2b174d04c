"""kvloom's Qwen3-Next against Hugging Face transformers (its torch fallback kernels, fla not
installed) on a tiny random-weight model, and schedule invariance in float64.

The tiny model exercises every Qwen3-Next piece: Gated DeltaNet with two value heads per key
head, gated full attention with GQA and partial rotary, sparse MoE (softmax top-k,
renormalised, sigmoid-gated shared expert) and a dense MLP layer (mlp_only_layers). Weights
are drawn with std 0.25 and the 1-D weights (zero-centred norms, the gated norm, A_log,
dt_bias) are randomised too, so a (1 + w) / w mix-up or a head-layout error moves logits.

Teacher-forced logits must match within LOGIT_TOL; greedy continuations of the 8 prompts
batched together must equal transformers' except at a position where transformers' own
top-2 margin is below MARGIN_TOL (reported).
"""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from kvloom import LLM, Engine
from kvloom.contracts.kv_cache_spec import LinearStateSpec
from kvloom.workers.cache_pages import pages_for
from kvloom.workers.row_kinds import RowKind
from tests.conftest import TOKENIZER_FILES, VOCAB
from tests.engine_helpers import PROMPTS, assert_pool_full, greedy, run_to_completion
from tests.oracle_helpers import assert_batched_greedy_matches, kvloom_prompt_logits

# fp32 rounding, not a model difference: on this model (logits up to ~9) kvloom fp32 and
# transformers fp32 each sit 1e-4..3e-4 from kvloom's float64 result, and ~1.4e-4 from each
# other; the chunked delta rule and the norms after it amplify last-bit differences.
LOGIT_TOL = 5e-4
MARGIN_TOL = 1e-4

TINY_QWEN3_NEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    decoder_sparse_step=1,
    mlp_only_layers=[2],
    max_position_embeddings=4096,
    bos_token_id=0,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def randomise(model: torch.nn.Module) -> None:
    """std-0.25 matrices (real greedy margins) and non-trivial 1-D weights and biases."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.25)
        for module in model.modules():
            if isinstance(module, Qwen3NextRMSNorm):  # zero-centred: (1 + w)
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.3)
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # gated norm: plain w
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.3)
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 4, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith(".bias"):  # attention_bias=True
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


# The other branches of the config: no renormalisation, MoE every 2nd layer (dense
# otherwise), one value head per key head, default partial rotary (0.25), layer types from
# full_attention_interval, tied embeddings, attention biases.
VARIANT = dict(
    TINY_QWEN3_NEXT,
    layer_types=None,
    full_attention_interval=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    linear_num_value_heads=2,
    norm_topk_prob=False,
    decoder_sparse_step=2,
    mlp_only_layers=[],
    tie_word_embeddings=True,
    attention_bias=True,
)


def save_tiny(out, tokenizer_dir, config: dict):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3NextConfig(**config), dtype=torch.float32
    )
    randomise(model)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, demo_tokenizer_dir):
    return save_tiny(
        tmp_path_factory.mktemp("tiny-qwen3-next"), demo_tokenizer_dir, TINY_QWEN3_NEXT
    )


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", progress=False, block_size=16)


def test_demo_checkpoint_runs_through_llm(tmp_path):
    """`kvloom demo-model --arch qwen3_next` output loads and generates through kvloom.LLM,
    and its prompt logits agree with transformers."""
    from kvloom.cluster.demo_model import write_demo_model

    path = write_demo_model(tmp_path / "demo", arch="qwen3_next", seed=3)
    demo = LLM(str(path), dtype="float32", progress=False, block_size=16)
    outs = demo.generate(["The quick brown fox", "Hello"], greedy(8))
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]
    assert all(isinstance(o.outputs[0].text, str) for o in outs)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = outs[0].prompt_token_ids + outs[0].outputs[0].token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert (kvloom_prompt_logits(demo, prompt) - ref).abs().max().item() <= LOGIT_TOL


def test_model_has_every_qwen3_next_piece(llm):
    model = llm.engine.executor.worker.runner.model
    kinds = [layer.kind for layer in model.model.layers]
    mlps = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == TINY_QWEN3_NEXT["layer_types"]
    assert mlps == ["Qwen3NextSparseMoe", "Qwen3NextSparseMoe", "GatedMLP", "Qwen3NextSparseMoe"]
    assert model.model.layers[1].self_attn.rotary.rotary_dim == 8  # half of head_dim 16


def test_teacher_forced_logits_match_transformers(llm, hf_model):
    errors = []
    for prompt in (PROMPTS[3], PROMPTS[7], list(range(3, 100))):
        ours = kvloom_prompt_logits(llm, prompt)
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt])).logits[0]
        assert ref.abs().max() > 1.0  # the logits are not near-uniform
        err = (ours - ref).abs().max().item()
        errors.append(err)
        assert err <= LOGIT_TOL, f"max |logit diff| {err:.3g} over {len(prompt)} tokens"
    print(f"qwen3_next teacher-forced max |logit diff| per prompt: {errors}")


def test_teacher_forced_logits_match_transformers_variant_config(tmp_path, demo_tokenizer_dir):
    path = save_tiny(tmp_path, demo_tokenizer_dir, VARIANT)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.layer_types == ["linear_attention", "full_attention"] * 2
    variant = LLM(str(path), dtype="float32", progress=False, block_size=16)
    mlps = [
        type(layer.mlp).__name__
        for layer in variant.engine.executor.worker.runner.model.model.layers
    ]
    assert mlps == ["GatedMLP", "Qwen3NextSparseMoe"] * 2
    prompt = list(range(3, 100))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    err = (kvloom_prompt_logits(variant, prompt) - ref).abs().max().item()
    print(f"qwen3_next variant teacher-forced max |logit diff|: {err}")
    assert err <= LOGIT_TOL


def test_batched_greedy_matches_transformers(llm, hf_model):
    assert_batched_greedy_matches(llm, hf_model, PROMPTS, "qwen3_next")


# ----------------------------------------------------------------------------- float64


def make_engine(model_dir, **kwargs) -> Engine:
    kwargs.setdefault("dtype", "float64")
    kwargs.setdefault("block_size", 4)
    return Engine(model=str(model_dir), progress=False, **kwargs)


@pytest.fixture(scope="module")
def alone(model_dir):
    """Each prompt run by itself on a fresh engine (float64)."""
    return [
        run_to_completion(make_engine(model_dir), [p], greedy(24))[0].outputs[0].token_ids
        for p in PROMPTS
    ]


@pytest.mark.parametrize("budget", [5, 64, 4096])
def test_batched_equals_alone_under_token_budgets(model_dir, alone, budget):
    engine = make_engine(model_dir, max_num_batched_tokens=budget)
    outs = run_to_completion(engine, PROMPTS, greedy(24))
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert_pool_full(engine)


def test_preemption_gives_same_tokens(model_dir, alone):
    # Each request needs up to 19 attention blocks of 4 plus one state page; 30 blocks
    # cannot hold the 8 together, so the scheduler preempts (recompute).
    engine = make_engine(model_dir, num_kv_blocks=30, enable_prefix_caching=False)
    outs = run_to_completion(engine, PROMPTS, greedy(24))
    assert engine.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert_pool_full(engine)


def page_contents(page: torch.Tensor) -> str:
    if bool(page.isnan().all()):
        return "nan"
    return "zeros" if bool((page == 0).all()) else "stale state"


@pytest.mark.parametrize("sanitize", [True, False])
def test_fresh_one_token_prompt_on_a_recycled_state_page(model_dir, alone, sanitize):
    """Seed 000/001's bug class: a step whose rows are all one token long — two ongoing
    decodes and a brand-new one-token prompt whose state page was just freed by a finished
    request — must give the new prompt exactly the tokens it gets alone. The pool is sized
    so the only free pages are the finished request's (least recently freed go first; a
    state spans 4 pages here, docs/kv_cache_pages.md)."""
    engine = make_engine(
        model_dir, sanitize=sanitize, enable_prefix_caching=False, num_kv_blocks=36
    )
    runner = engine.executor.worker.runner
    linear_group = next(
        i for i, g in enumerate(runner.groups) if isinstance(g.spec, LinearStateSpec)
    )
    gdn = runner.model.model.layers[0].linear_attn
    # per step: ({request: state page}, row kinds, tokens, {request: what its page holds})
    steps = []
    build = runner.build_batch

    def recording_build(sched):
        out = build(sched)
        reqs = runner.input_batch.requests
        live = {rid: reqs[rid].block_ids[linear_group][0] for rid in sched.num_scheduled_tokens}
        found = {rid: page_contents(gdn.recurrent_state[p]) for rid, p in live.items()}
        steps.append((live, list(out[1].rows.kinds), out[1].rows.num_scheduled_tokens, found))
        return out

    runner.build_batch = recording_build
    # Prompt lengths 17 and 33 (1 mod 4): "a" and "b" need no new page in the step that
    # admits "fresh", so fresh's state page is the first page "short" gave back: its state.
    engine.add_request("a", {"prompt_token_ids": PROMPTS[4]}, greedy(24))
    engine.add_request("b", {"prompt_token_ids": PROMPTS[6]}, greedy(24))
    engine.add_request("short", {"prompt_token_ids": PROMPTS[5]}, greedy(2))
    done = {}
    while "short" not in done:
        done.update({o.request_id: o for o in engine.step() if o.finished})
    short_state_page = steps[-1][0]["short"]
    engine.add_request("fresh", {"prompt_token_ids": PROMPTS[0]}, greedy(24))  # one token
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})

    live, kinds, tokens, found = next(step for step in steps if "fresh" in step[0])
    assert list(live) == ["a", "b", "fresh"] and tokens == [1, 1, 1]
    assert kinds == [RowKind.RESUME, RowKind.RESUME, RowKind.FRESH]
    assert live["fresh"] == short_state_page  # holds the finished request's state
    # Poisoned by the sanitizer, or else still the finished request's state: either way
    # the fresh row must not read it.
    assert found["fresh"] == ("nan" if sanitize else "stale state")
    assert done["fresh"].outputs[0].token_ids == alone[0]
    assert done["a"].outputs[0].token_ids == alone[4]
    assert done["b"].outputs[0].token_ids == alone[6]
    assert_pool_full(engine)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_prefill_gives_same_tokens(model_dir, alone, chunk):
    """One-token (and longer) chunks that resume a partial prefill keep their state."""
    engine = make_engine(model_dir, long_prefill_token_threshold=chunk)
    outs = run_to_completion(engine, PROMPTS, greedy(24))
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert_pool_full(engine)


def test_prefix_cache_hits_give_same_tokens(model_dir, alone):
    """A second round of the same prompts is served from state checkpoints."""
    engine = make_engine(model_dir)
    run_to_completion(engine, PROMPTS, greedy(24))
    outs = run_to_completion(engine, PROMPTS, greedy(24))
    assert engine.stats()["prefix_cache_hit_tokens"] > 0
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert_pool_full(engine)


# ----------------------------------------------------------------------------- TP = 2


class ThreadTPGroup:
    """One rank of a TP group whose ranks are threads of this process: collectives meet at
    a barrier and combine in rank order (exact, like a real all-reduce of two ranks)."""

    def __init__(self, rank: int, world_size: int, shared: dict):
        self.rank, self.world_size, self.shared = rank, world_size, shared

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = tensor
        barrier.wait()
        parts = list(slots)
        barrier.wait()  # nobody overwrites a slot before everyone has read it
        return parts

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(tensor)
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._exchange(tensor), dim=dim)


def load_rank(model_dir, tp) -> torch.nn.Module:
    """One rank's float64 model with its cache pages, loaded from the checkpoint."""
    import json

    from kvloom.workers.models.qwen3_next import Qwen3NextForCausalLM
    from kvloom.workers.weight_loader import iterate_checkpoint, load_weights

    config = json.loads((model_dir / "config.json").read_text())
    model = Qwen3NextForCausalLM(config, torch.float64, tp)
    load_weights(
        model,
        iterate_checkpoint(model_dir, progress=False),
        model.stacked_params,
        model.ignored_weight_prefixes,
        model.tied,
    )
    specs = model.kv_cache_specs(4, "float64")
    for layer in model.cache_layers():
        spec = specs[layer.layer_index]
        layer.allocate_cache(pages_for(spec, 64, "cpu"), spec)
    return model


def forward_batch(model, rows: list[tuple[list[int], int, int]]):
    """rows: (new token ids, tokens computed before, request slot). Request slot s owns
    attention blocks 8s..8s+7 (block size 4) and state page 40 + s."""
    from kvloom.cluster.kv_cache.planner import group_layers
    from kvloom.workers.attention_metadata import ForwardBatch, GroupMetadata
    from kvloom.workers.row_kinds import RowClasses, classify_rows

    groups = group_layers(model.kv_cache_specs(4, "float64"))
    ids, positions, starts, seq_lens, computed, scheduled = [], [], [0], [], [], []
    for tokens, before, _ in rows:
        ids += tokens
        positions += range(before, before + len(tokens))
        starts.append(starts[-1] + len(tokens))
        seq_lens.append(before + len(tokens))
        computed.append(before)
        scheduled.append(len(tokens))
    metas = []
    for group in groups:
        if isinstance(group.spec, LinearStateSpec):
            table = torch.tensor([[40 + s] for *_, s in rows], dtype=torch.int32)
            meta = GroupMetadata(table, torch.empty(0, dtype=torch.long))
            meta.state_indices = table[:, 0].long()
        else:
            table = torch.tensor([[8 * s + b for b in range(8)] for *_, s in rows])
            slots = [
                8 * s * 4 + p
                for tokens, before, s in rows
                for p in range(before, before + len(tokens))
            ]
            meta = GroupMetadata(table.int(), torch.tensor(slots))
        metas.append(meta)
    batch = ForwardBatch(
        positions=torch.tensor(positions),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_computed_tokens=torch.tensor(computed, dtype=torch.int32),
        query_start_loc_list=starts,
        seq_lens_list=seq_lens,
        rows=RowClasses(classify_rows(computed, scheduled), scheduled),
        groups=metas,
        layer_to_group={i: g for g, grp in enumerate(groups) for i in grp.layer_names},
    )
    return torch.tensor(ids), batch


# Three steps over two requests: fresh prefills; a resume chunk of 5 beside a decode; then
# two decodes (the chunked, the single-step and the mixed paths all run).
TP_STEPS = [
    [(PROMPTS[3][:11], 0, 0), (PROMPTS[5][:6], 0, 1)],
    [(PROMPTS[3][11:16], 11, 0), (PROMPTS[5][6:7], 6, 1)],
    [([7], 16, 0), (PROMPTS[5][7:8], 7, 1)],
]


def run_steps(model) -> list[torch.Tensor]:
    logits = []
    with torch.inference_mode():
        for rows in TP_STEPS:
            ids, batch = forward_batch(model, rows)
            logits.append(model.compute_logits(model(ids, batch.positions, batch)))
    return logits


def test_tensor_parallel_two_ranks_match_one(model_dir):
    import threading

    reference = run_steps(load_rank(model_dir, None))
    shared = {"slots": [None, None], "barrier": threading.Barrier(2, timeout=60)}
    ranks = [load_rank(model_dir, ThreadTPGroup(r, 2, shared)) for r in range(2)]
    gdn = ranks[1].model.layers[0].linear_attn
    assert (gdn.num_k_heads, gdn.num_v_heads) == (1, 2)  # half of each
    assert ranks[1].model.layers[0].mlp.experts.w2.shape[-1] == 16
    results: list = [None, None]

    def work(r):
        results[r] = run_steps(ranks[r])

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for rank_logits in results:
        for ours, ref in zip(rank_logits, reference, strict=True):
            torch.testing.assert_close(ours, ref, rtol=0, atol=1e-10)
