"""The `mtp` drafter (workers/spec_decode/mtp.py): the MTP layer Qwen3-Next and Qwen3.5
checkpoints ship as `mtp.*` tensors, loaded from the target's own checkpoint.

Format: tiny checkpoints written with the published names and shapes load; a missing or
misshaped tensor is named; an MTP-less checkpoint is refused at start. Lossless: greedy
and seeded sampling equal plain decoding (float64) with chunked prefill, preemption,
prefix hits and async scheduling. Acceptance: a target that is a pure function of its
last token, and an MTP head wired to compute that same function from the token
embedding, has every draft accepted (so the embedding half, the norms, fc's column order
and the shared LM head are all where the format puts them).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvloom import Engine, SamplingParams
from kvloom.workers.spec_decode.mtp import mtp_tensor_shapes, write_mtp_checkpoint
from tests.engine_helpers import assert_pool_full, greedy, multi_turn, run_to_completion
from tests.test_spec_decode_engine import (
    placeholder_steps,
    record_steps,
    repetitive_prompts,
    spec_workload,
)

MTP = {"method": "mtp", "num_speculative_tokens": 3}


def engine(path, **kw) -> Engine:
    kw.setdefault("block_size", 4)
    return Engine(model=str(path), dtype="float64", progress=False, **kw)


def same_tokens(outs, expected) -> bool:
    return [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]


@pytest.fixture(scope="module")
def next_mtp(hybrid_model, tmp_path_factory):
    """The tiny Qwen3-Next demo (MoE layers) with a random MTP layer added."""
    return write_mtp_checkpoint(hybrid_model("qwen3_next"), tmp_path_factory.mktemp("next-mtp"))


def mtp_headers(path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path / "mtp.safetensors"), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118


# -- format ------------------------------------------------------------------------------


def test_written_checkpoint_has_the_published_names_and_shapes(next_mtp):
    config = json.loads((next_mtp / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    hidden, heads, head_dim = config["hidden_size"], config["num_attention_heads"], 16
    found = mtp_headers(next_mtp)
    assert found["mtp.fc.weight"] == (hidden, 2 * hidden)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        assert found[f"mtp.{norm}.weight"] == (hidden,)
    p = "mtp.layers.0."
    assert found[p + "self_attn.q_proj.weight"] == (2 * heads * head_dim, hidden)  # + gate
    assert found[p + "self_attn.q_norm.weight"] == (head_dim,)
    assert found[p + "mlp.gate.weight"] == (config["num_experts"], hidden)
    assert found[p + "mlp.experts.3.down_proj.weight"] == (hidden, config["moe_intermediate_size"])
    assert found[p + "mlp.shared_expert_gate.weight"] == (1, hidden)
    assert not any(".linear_attn." in name for name in found)  # a full-attention layer
    assert set(found) == set(mtp_tensor_shapes("Qwen3NextForCausalLM", config, 1))


def test_head_loads_with_the_targets_kind_of_layer(next_mtp):
    eng = engine(next_mtp, speculative_config=MTP)
    runner = eng.executor.worker.runner
    head = runner.draft.model
    assert type(head.layers[0]) is type(runner.model.model.layers[0])
    assert type(head.layers[0].mlp).__name__ == "Qwen3NextSparseMoe"
    assert head.layers[0].kind == "full_attention"
    want = load_file(next_mtp / "mtp.safetensors")["mtp.pre_fc_norm_hidden.weight"]
    torch.testing.assert_close(head.pre_fc_norm_hidden.weight, want.double())
    kinds = {type(g.spec).__name__ for g in eng.kv_cache.groups}
    assert kinds == {"FullAttentionSpec", "LinearStateSpec"}  # the MTP layer joins a group


def test_sharded_checkpoint_with_an_index_loads(next_mtp, tmp_path):
    """As published: shards named by model.safetensors.index.json, the MTP layer in one."""
    out = tmp_path / "sharded"
    out.mkdir()
    for f in next_mtp.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    shards = {
        "model-00001-of-00002.safetensors": load_file(next_mtp / "model.safetensors"),
        "model-00002-of-00002.safetensors": load_file(next_mtp / "mtp.safetensors"),
    }
    weight_map = {}
    for name, tensors in shards.items():
        save_file(tensors, out / name)
        weight_map.update(dict.fromkeys(tensors, name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    spec = engine(out, speculative_config=MTP)
    ours = spec.executor.worker.runner.draft.model.state_dict()
    want = engine(next_mtp, speculative_config=MTP).executor.worker.runner.draft.model
    for name, tensor in want.state_dict().items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=0, msg=name)
    run_to_completion(spec, repetitive_prompts(2), greedy(8))
    assert spec.stats()["spec_drafted_tokens"] > 0


def test_mtp_less_checkpoint_is_refused_at_start(hybrid_model, tiny_model, monkeypatch):
    """The refusal comes before the target's weights are read."""
    from kvloom.workers import model_runner

    def no_load(*args, **kwargs):
        raise AssertionError("the target loaded before the MTP check")

    monkeypatch.setattr(model_runner, "load_weights", no_load)
    with pytest.raises(ValueError, match=r"method 'mtp'.*no MTP weights \(no mtp\.\* tensors"):
        engine(hybrid_model("qwen3_next"), speculative_config=MTP)
    with pytest.raises(ValueError, match=r"method 'mtp'.*Qwen3-Next / Qwen3.5.*Qwen3ForCausalLM"):
        engine(tiny_model("qwen3"), speculative_config=MTP)


def test_dummy_weights_give_a_random_mtp_layer(hybrid_model):
    """Benchmarks of real shapes (load_format="dummy") need no mtp.* tensors."""
    path = hybrid_model("qwen3_next")
    prompts = repetitive_prompts(2)
    spec = engine(path, load_format="dummy", speculative_config=MTP)
    assert len(spec.executor.worker.runner.draft.model.layers) == 1
    outs = run_to_completion(spec, prompts, greedy(8))
    assert same_tokens(
        outs, run_to_completion(engine(path, load_format="dummy"), prompts, greedy(8))
    )
    assert spec.stats()["spec_drafted_tokens"] > 0


def rewrite_mtp(src, dst, edit) -> None:
    shutil.copytree(src, dst)
    tensors = load_file(src / "mtp.safetensors")
    edit(tensors)
    save_file(tensors, dst / "mtp.safetensors")


def test_missing_misshaped_and_unexpected_tensors_are_named(next_mtp, tmp_path):
    rewrite_mtp(next_mtp, tmp_path / "a", lambda t: t.pop("mtp.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(
        ValueError, match=r"lacks 1 MTP tensor\(s\): mtp\.layers\.0\.self_attn\.k_proj"
    ):
        engine(tmp_path / "a", speculative_config=MTP)

    def misshape(t):
        t["mtp.fc.weight"] = t["mtp.fc.weight"][:, :64].contiguous()

    rewrite_mtp(next_mtp, tmp_path / "b", misshape)
    with pytest.raises(
        ValueError, match=r"mtp\.fc\.weight has shape \[64, 64\], expected \[64, 128\]"
    ):
        engine(tmp_path / "b", speculative_config=MTP)

    def extra(t):
        t["mtp.layers.0.mlp.experts.9.up_proj.weight"] = torch.zeros(32, 64)

    rewrite_mtp(next_mtp, tmp_path / "c", extra)
    with pytest.raises(
        ValueError, match=r"unexpected MTP tensor\(s\): mtp\.layers\.0\.mlp\.experts\.9"
    ):
        engine(tmp_path / "c", speculative_config=MTP)


def test_config_without_mtp_layers_or_with_two_is_refused(next_mtp, tmp_path):
    for count, message in ((0, r"no MTP layers \(num_nextn_predict_layers = 0"), (2, r"has 2 MTP")):
        out = tmp_path / f"n{count}"
        shutil.copytree(next_mtp, out)
        config = json.loads((out / "config.json").read_text())
        config["num_nextn_predict_layers"] = count
        (out / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            engine(out, speculative_config=MTP)


# -- lossless ----------------------------------------------------------------------------


def test_qwen3_next_mtp_greedy_is_lossless_with_chunks_and_preemption(next_mtp):
    prompts = repetitive_prompts()
    expected = run_to_completion(engine(next_mtp), prompts, greedy(24))
    spec = engine(next_mtp, speculative_config=MTP, num_kv_blocks=75, max_num_batched_tokens=7)
    assert same_tokens(run_to_completion(spec, prompts, greedy(24)), expected)
    stats = spec.stats()
    assert stats["spec_drafted_tokens"] > 0 and stats["num_preemptions"] > 0
    assert_pool_full(spec)


def test_qwen3_next_mtp_keeps_prefix_hits_and_seeded_sampling_exact(next_mtp):
    plain, spec = engine(next_mtp), engine(next_mtp, speculative_config=MTP)
    turns = multi_turn(spec)
    assert [[o.outputs[0].token_ids for _, o in t] for t in turns] == [
        [o.outputs[0].token_ids for _, o in t] for t in multi_turn(plain)
    ]
    assert spec.stats()["prefix_cache_hit_tokens"] > 0
    prompts = repetitive_prompts(4)
    params = [
        SamplingParams(max_tokens=24, temperature=0.8, top_k=20, seed=3 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    assert same_tokens(
        run_to_completion(spec, prompts, params), run_to_completion(plain, prompts, params)
    )
    assert spec.stats()["spec_drafted_tokens"] > 0


def test_async_mtp_matches_the_synchronous_engine(next_mtp):
    setting = dict(
        speculative_config=MTP,
        block_size=16,
        num_kv_blocks=40,
        max_num_batched_tokens=16,
        device="cpu",
    )
    want = spec_workload(engine(next_mtp, async_scheduling=False, **setting))
    eng = engine(next_mtp, async_scheduling=True, **setting)
    steps = record_steps(eng)
    assert spec_workload(eng) == want
    stats = eng.stats()
    assert stats["spec_drafted_tokens"] > 0 and stats["num_preemptions"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    assert placeholder_steps(steps) > len(steps) / 4, (placeholder_steps(steps), len(steps))
    assert_pool_full(eng)


# -- acceptance --------------------------------------------------------------------------


def bigram_target_with_copying_mtp(src, out):
    """Every token mixer and MLP of the target writes zeros, so its hidden state is
    final_norm(embed(x_t)) and its next token a function f(x_t). The MTP head's attention
    and MLP write zeros too, fc passes the normalised embedding through (fc = [I | 0]) with
    the target's final-norm weight, and mtp.norm only rescales: it drafts f(x_t), f(f(x_t)),
    ... which is exactly what the target then emits."""
    shutil.copytree(src, out)
    weights = load_file(out / "model.safetensors")
    silent = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
    for name in weights:
        if name.endswith(silent):
            weights[name] = torch.zeros_like(weights[name])
    save_file(weights, out / "model.safetensors")
    hidden = weights["model.norm.weight"].shape[0]
    config = json.loads((out / "config.json").read_text())
    shapes = mtp_tensor_shapes(config["architectures"][0], config, 1)
    overrides = {n: torch.zeros(s) for n, s in shapes.items() if n.endswith(silent)}
    overrides["mtp.fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1)
    overrides["mtp.pre_fc_norm_embedding.weight"] = weights["model.norm.weight"]
    overrides["mtp.norm.weight"] = torch.zeros(hidden)
    return write_mtp_checkpoint(out, out, overrides=overrides)


def test_mtp_that_matches_the_target_has_every_draft_accepted(hybrid_model, tmp_path):
    path = bigram_target_with_copying_mtp(hybrid_model("qwen3_next"), tmp_path / "bigram")
    prompts = repetitive_prompts()
    spec = engine(path, speculative_config=MTP, num_kv_blocks=75, max_num_batched_tokens=16)
    assert same_tokens(
        run_to_completion(spec, prompts, greedy(24)),
        run_to_completion(engine(path), prompts, greedy(24)),
    )
    stats = spec.stats()
    assert stats["spec_accepted_tokens"] == stats["spec_drafted_tokens"] > 0
    assert stats["spec_mean_accepted_length"] > 3  # k = 3: up to 4 tokens a step


def test_each_token_is_paired_with_the_hidden_state_before_it(hybrid_model, tmp_path):
    """An MTP head that passes only the hidden-state half through (fc = [0 | I], attention
    and MLP silent, norms only rescaling) drafts argmax(lm_head(h)) of the hidden state it
    is given. An entry pairs token x_{p+1} with h_p, as the format has it, so a row's last
    entry drafts the target's own greedy token at p: the token just emitted, which every
    proposal then repeats."""
    config = json.loads((hybrid_model("qwen3_next") / "config.json").read_text())
    hidden = config["hidden_size"]
    shapes = mtp_tensor_shapes(config["architectures"][0], config, 1)
    silent = ("o_proj.weight", "down_proj.weight")
    overrides = {n: torch.zeros(s) for n, s in shapes.items() if n.endswith(silent)}
    overrides["mtp.fc.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], 1)
    overrides["mtp.pre_fc_norm_hidden.weight"] = torch.zeros(hidden)
    overrides["mtp.norm.weight"] = torch.zeros(hidden)
    path = write_mtp_checkpoint(hybrid_model("qwen3_next"), tmp_path / "echo", overrides=overrides)
    spec = engine(path, speculative_config=MTP, max_num_batched_tokens=7)
    drafter = spec.executor.worker.runner.draft
    seen = []

    def recording(step):
        proposals = run(step)
        seen.extend((token, proposals[rid]) for rid, _, _, token in step.starts())
        return proposals

    run, drafter.run = drafter.run, recording
    prompts = repetitive_prompts(4)
    outs = run_to_completion(spec, prompts, greedy(20))
    assert same_tokens(outs, run_to_completion(engine(path), prompts, greedy(20)))
    assert len(seen) > 20
    assert all(proposal == [token] * 3 for token, proposal in seen), seen[:5]


# -- Qwen3.5 -----------------------------------------------------------------------------


def build_qwen3_5_dense(out, tokenizer_dir) -> None:
    """Qwen3.5 (dense) as transformers writes it: Qwen3_5ForCausalLM, `model.layers.N`."""
    import transformers

    from tests.conftest import TOKENIZER_FILES
    from tests.test_oracle_qwen3_5 import TINY_QWEN3_5
    from tests.test_oracle_qwen3_next import randomise

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3_5TextConfig(**TINY_QWEN3_5), dtype=torch.float32
    )
    randomise(model)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)


@pytest.fixture(scope="module", params=["dense", "moe-multimodal"])
def qwen3_5_mtp(request, tmp_path_factory, demo_tokenizer_dir):
    """Qwen3.5 dense (the text model's layout), and Qwen3.5-MoE as published: the
    multimodal layout (text_config nested, decoder under model.language_model.) with the
    MTP layer's experts as 3-D stacks."""
    from tests.test_oracle_qwen3_5_layouts import build

    out = tmp_path_factory.mktemp(f"qwen3_5-{request.param}")
    if request.param == "dense":
        build_qwen3_5_dense(out, demo_tokenizer_dir)
    else:
        build("moe", out, demo_tokenizer_dir)
    mtp = tmp_path_factory.mktemp(f"qwen3_5-{request.param}-mtp")
    return request.param, write_mtp_checkpoint(out, mtp, fused_experts=request.param != "dense")


def test_qwen3_5_layouts_load_and_are_lossless(qwen3_5_mtp):
    kind, path = qwen3_5_mtp
    config = json.loads((path / "config.json").read_text())
    found = mtp_headers(path)
    if kind == "dense":
        assert config["mtp_num_hidden_layers"] == 1
        assert found["mtp.layers.0.mlp.gate_proj.weight"] == (96, 64)
    else:
        assert config["text_config"]["mtp_num_hidden_layers"] == 1
        assert found["mtp.layers.0.mlp.experts.gate_up_proj"] == (4, 64, 64)
        assert found["mtp.layers.0.mlp.experts.down_proj"] == (4, 64, 32)
    prompts = repetitive_prompts(4)
    spec = engine(path, speculative_config=MTP, block_size=16, max_num_batched_tokens=8)
    head = spec.executor.worker.runner.draft.model
    assert type(head.layers[0]).__name__ == "Qwen3_5DecoderLayer"
    mlp = "GatedMLP" if kind == "dense" else "Qwen3NextSparseMoe"
    assert type(head.layers[0].mlp).__name__ == mlp
    expected = run_to_completion(engine(path, block_size=16), prompts, greedy(16))
    assert same_tokens(run_to_completion(spec, prompts, greedy(16)), expected)
    assert spec.stats()["spec_drafted_tokens"] > 0
    assert_pool_full(spec)


# -- tensor parallelism ------------------------------------------------------------------


@pytest.mark.slow
def test_mtp_at_tp2_over_ray_matches_tp1(local_ray, next_mtp):
    """Each rank builds the MTP layer's slice (sharded attention and experts, replicated
    fc and norms) and drafts alike; tokens are the TP 1 engine's (float64)."""
    prompts = repetitive_prompts(4)
    setting = dict(speculative_config=MTP, max_num_batched_tokens=16, device="cpu")
    want = run_to_completion(engine(next_mtp, **setting), prompts, greedy(16))
    eng = engine(next_mtp, executor="ray", tensor_parallel_size=2, **setting)
    try:
        assert same_tokens(run_to_completion(eng, prompts, greedy(16)), want)
        assert eng.stats()["spec_drafted_tokens"] > 0
    finally:
        eng.shutdown()


@pytest.mark.gpu
def test_gpu_mtp_that_matches_the_target_has_every_draft_accepted(hybrid_model, tmp_path):
    """The acceptance check on CUDA (float32, the Triton kernels): the bigram target's
    tokens do not depend on batching, so plain and speculative runs agree exactly."""
    path = bigram_target_with_copying_mtp(hybrid_model("qwen3_next"), tmp_path / "bigram")
    prompts = repetitive_prompts()
    setting = dict(dtype="float32", device="cuda", block_size=16, progress=False)
    spec = Engine(model=str(path), speculative_config=MTP, **setting)
    outs = run_to_completion(spec, prompts, greedy(24))
    plain = run_to_completion(Engine(model=str(path), **setting), prompts, greedy(24))
    assert same_tokens(outs, plain)
    stats = spec.stats()
    assert stats["spec_accepted_tokens"] == stats["spec_drafted_tokens"] > 0
    assert_pool_full(spec)


def test_mtp_catch_up_replays_verification_graphs_with_the_eager_drafts(next_mtp):
    """With stand-in graphs, uniform verification steps catch the head up in one
    (rows, k + 1) replay over every entry, rejected drafts included: the drafts and tokens
    are the eager engine's, under chunked prefill, preemption and prefix hits."""
    from tests.test_verification_graphs import engine as f64_engine
    from tests.test_verification_graphs import graph_engine, record_drafts, setting, workload

    settings = dict(setting(next_mtp), num_kv_blocks=80)  # the head's layer books KV too
    plain = workload(f64_engine(next_mtp, **settings))
    eager = f64_engine(next_mtp, speculative_config=MTP, device="cpu", **settings)
    eager_drafts = record_drafts(eager)
    assert workload(eager) == plain
    eng = graph_engine(next_mtp, speculative_config=MTP, **settings)
    drafts = record_drafts(eng)
    assert workload(eng) == plain
    assert drafts == eager_drafts
    runner = eng.executor.worker.runner
    assert runner.draft.catch_up_graphs.replays > 0
    stats = eng.stats()
    assert stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"]  # rejections too
    assert stats["num_preemptions"] > 0
    assert_pool_full(eng)
    # Prefix hits (this small pool evicts them): conversations on a default-sized pool.
    eng = graph_engine(next_mtp, speculative_config=MTP)
    got = [[o.outputs[0].token_ids for _, o in t] for t in multi_turn(eng)]
    want = [[o.outputs[0].token_ids for _, o in t] for t in multi_turn(f64_engine(next_mtp))]
    assert got == want
    assert eng.stats()["prefix_cache_hit_tokens"] > 0
    assert eng.executor.worker.runner.draft.catch_up_graphs.replays > 0
