"""The `eagle3` drafter: published EAGLE-3 heads load (tensor names, shapes, the draft
vocabulary's d2t/t2d maps, auxiliary layers), bad checkpoints are refused naming what is
wrong, and speculation with a random head is lossless on dense and Qwen3-Next targets
(float64; chunked prefill, preemption, prefix hits, async scheduling)."""

from __future__ import annotations

import pytest
import torch

from tests.engine_helpers import (
    assert_finite_drafter,
    assert_pool_full,
    drafter_of,
    greedy,
    multi_turn,
    run_to_completion,
)
from tests.test_spec_decode_engine import (
    engine,
    placeholder_steps,
    record_steps,
    repetitive_prompts,
    spec_workload,
)

DRAFT_VOCAB = 200  # of the target's 512: draft id i drafts target id 2i


def target_path(kind, tiny_model, hybrid_model):
    return tiny_model("qwen3") if kind == "dense" else hybrid_model("qwen3_next")


def write_head(tmp_path, target, name="head", **kw):
    from kvloom.workers.spec_decode.eagle3 import write_eagle3_head

    kw.setdefault("draft_vocab_size", DRAFT_VOCAB)
    kw.setdefault("aux_layer_ids", [0, 1, 2])
    return write_eagle3_head(tmp_path / name, target, **kw)


def eagle3(head, k: int = 3) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


# -- format ---------------------------------------------------------------------------


def test_published_layout_loads_with_its_draft_vocabulary(tiny_model, tmp_path):
    from kvloom.workers.spec_decode.eagle3 import Eagle3Proposer

    target = tiny_model("qwen3")
    eng = engine(target, speculative_config=eagle3(write_head(tmp_path, target)))
    draft = drafter_of(eng)
    assert isinstance(draft, Eagle3Proposer)
    assert draft.format.aux_layer_ids == [0, 1, 2]
    assert draft.draft_targets.tolist() == [2 * i for i in range(DRAFT_VOCAB)]
    # A crafted LM head row wins the argmax: its draft id maps through d2t.
    head = draft.model.lm_head.weight
    hidden = torch.randn(1, head.shape[1], dtype=head.dtype)
    with torch.no_grad():
        head.zero_()
        head[37] = hidden[0]
    assert draft.draft_ids(hidden).tolist() == [74]


def test_the_target_embedding_is_shared_unless_the_head_has_its_own(tiny_model, tmp_path):
    target = tiny_model("qwen3")
    shared = drafter_of(engine(target, speculative_config=eagle3(write_head(tmp_path, target))))
    own_dir = write_head(tmp_path, target, "own", own_embedding=True)
    own = drafter_of(engine(target, speculative_config=eagle3(own_dir)))
    assert shared.model.embed_tokens is None
    ids = torch.tensor([3, 5])
    assert torch.equal(shared.embed(ids), shared.target.model.embed_tokens(ids))
    assert own.model.embed_tokens is not None
    assert not torch.equal(own.embed(ids), own.target.model.embed_tokens(ids))


def test_a_narrower_head_with_its_own_embedding_drafts_losslessly(tiny_model, tmp_path):
    """hidden_size 32 beside a 64-wide target: fc reads 3 x target_hidden_size and the head
    embeds with its own table."""
    target = tiny_model("qwen3")
    head = write_head(tmp_path, target, hidden_size=32, own_embedding=True)
    spec = engine(target, speculative_config=eagle3(head))
    assert drafter_of(spec).format.target_hidden == 64
    prompts = repetitive_prompts(3)
    outs = run_to_completion(spec, prompts, greedy(16))
    expected = run_to_completion(engine(target), prompts, greedy(16))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert spec.stats()["spec_drafted_tokens"] > 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"midlayer.self_attn.k_proj.weight": None}, "lacks 1 tensor.*midlayer.self_attn.k_proj"),
        (
            {"fc.weight": torch.zeros(64, 128)},
            r"fc.weight has shape \[64, 128\], expected \[64, 192\]",
        ),
        ({"d2t": None, "t2d": None}, "lacks 1 tensor.*d2t"),
        ({"lm_head.weight": torch.zeros(512, 64)}, r"lm_head.weight has shape \[512, 64\]"),
        ({"t2d": torch.ones(512, dtype=torch.bool)}, "t2d does not mark exactly"),
        ({"midlayer.extra.weight": torch.zeros(2)}, "unexpected tensor.*midlayer.extra.weight"),
    ],
    ids=["missing", "misshaped", "no-d2t", "lm-head-over-full-vocab", "t2d-mismatch", "unexpected"],
)
def test_bad_tensors_are_refused_by_name(tiny_model, tmp_path, overrides, message):
    target = tiny_model("qwen3")
    head = write_head(tmp_path, target, overrides=overrides)
    with pytest.raises(ValueError, match=message):
        engine(target, speculative_config=eagle3(head))


def test_bad_configs_are_refused_by_field(tiny_model, tmp_path):
    import json

    target = tiny_model("qwen3")
    narrow = write_head(tmp_path, target, "narrow", hidden_size=32)
    with pytest.raises(
        ValueError, match="hidden_size 32 does not match the target's hidden_size 64"
    ):
        engine(target, speculative_config=eagle3(narrow))
    deep = write_head(tmp_path, target, "deep", aux_layer_ids=[0, 1, 7])
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids \[0, 1, 7\]"):
        engine(target, speculative_config=eagle3(deep))
    default = write_head(tmp_path, target, "default", aux_layer_ids=None)
    with pytest.raises(ValueError, match=r"default aux layers \(2, L/2, L-3\) for a 2-layer"):
        engine(target, speculative_config=eagle3(default))
    other = write_head(tmp_path, target, "other")
    config = json.loads((other / "config.json").read_text())
    config["architectures"] = ["KvloomEagleHead"]
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="is not an EAGLE-3 head"):
        engine(target, speculative_config=eagle3(other))


# -- lossless -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dense", "qwen3_next"])
def test_eagle3_is_lossless_with_chunks_preemption_and_prefix_hits(
    tiny_model, hybrid_model, tmp_path, kind
):
    target = target_path(kind, tiny_model, hybrid_model)
    head = write_head(tmp_path, target)
    plain = engine(target)
    spec = engine(
        target, speculative_config=eagle3(head), num_kv_blocks=80, max_num_batched_tokens=16
    )
    proposed = record_drafts(spec)
    checked = assert_finite_drafter(spec)
    prompts = repetitive_prompts()
    expected = run_to_completion(plain, prompts, greedy(30))
    outs = run_to_completion(spec, prompts, greedy(30))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    turns = multi_turn(spec)
    assert [[o.outputs[0].token_ids for _, o in t] for t in turns] == [
        [o.outputs[0].token_ids for _, o in t] for t in multi_turn(plain)
    ]
    stats = spec.stats()
    assert checked and stats["spec_drafted_tokens"] > 0
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    # Every draft is a target id of the draft vocabulary (d2t applied), many beyond it.
    assert proposed and all(t % 2 == 0 and t < 2 * DRAFT_VOCAB for t in proposed)
    assert max(proposed) >= DRAFT_VOCAB
    assert_pool_full(spec)


def record_drafts(eng) -> list[int]:
    """Every draft token the worker's drafter proposes."""
    draft = drafter_of(eng)
    seen: list[int] = []
    run = draft.run

    def recording(step):
        out = run(step)
        for tokens in out.values():
            seen.extend(tokens)
        return out

    draft.run = recording
    return seen


@pytest.mark.parametrize("kind", ["dense", "qwen3_next"])
def test_seeded_sampling_with_eagle3_equals_no_speculation(
    tiny_model, hybrid_model, tmp_path, kind
):
    """Seeded sampling draws the same tokens with and without speculation (the rejection
    sampler's keyed noise), so its distribution is the target's."""
    from kvloom import SamplingParams

    target = target_path(kind, tiny_model, hybrid_model)
    prompts = repetitive_prompts(4)
    params = [
        SamplingParams(max_tokens=24, temperature=0.8, top_k=20, seed=11 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    expected = run_to_completion(engine(target), prompts, params)
    spec = engine(target, speculative_config=eagle3(write_head(tmp_path, target)))
    outs = run_to_completion(spec, prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert spec.stats()["spec_drafted_tokens"] > 0


@pytest.mark.parametrize("kind", ["dense", "qwen3_next"])
def test_async_eagle3_matches_the_synchronous_engine(tiny_model, hybrid_model, tmp_path, kind):
    target = target_path(kind, tiny_model, hybrid_model)
    head = write_head(tmp_path, target)
    hybrid = kind == "qwen3_next"
    setting = dict(
        speculative_config=eagle3(head),
        block_size=16 if hybrid else 4,
        num_kv_blocks=40 if hybrid else 60,
        max_num_batched_tokens=16,
        device="cpu",
    )
    want = spec_workload(engine(target, async_scheduling=False, **setting))
    eng = engine(target, async_scheduling=True, **setting)
    checked = assert_finite_drafter(eng)
    steps = record_steps(eng)
    assert spec_workload(eng) == want
    stats = eng.stats()
    assert checked and stats["spec_drafted_tokens"] > 0 and stats["num_preemptions"] > 0
    assert placeholder_steps(steps) > 0
    assert_pool_full(eng)


# -- the published forward, in plain torch ---------------------------------------------


def rms(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x, positions, theta=10000.0):
    """Neox-style rotation with cos/sin tabulated in float32, as Hugging Face does."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = positions[:, None].float() * inv[None]
    cos, sin = freqs.cos().to(x.dtype)[:, None], freqs.sin().to(x.dtype)[:, None]
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def reference_eagle3_drafts(w, config, aux, tokens, embed, k):
    """EAGLE-3 as the EAGLE repository runs it: entry p is token x_{p+1} beside fc(aux at
    p); each proposal appends (its draft, the pre-norm state) and reruns causally."""
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config["head_dim"]
    m = "midlayer."
    states = aux @ w["fc.weight"].T
    ids = list(tokens[1:])
    drafts = []
    for _ in range(k):
        n = len(ids)
        e = rms(embed[torch.tensor(ids)], w[m + "input_layernorm.weight"])
        x = torch.cat([e, rms(states, w[m + "hidden_norm.weight"])], -1)
        pos = torch.arange(n)
        q = rope((x @ w[m + "self_attn.q_proj.weight"].T).view(n, heads, hd), pos)
        kk = rope((x @ w[m + "self_attn.k_proj.weight"].T).view(n, kv, hd), pos)
        vv = (x @ w[m + "self_attn.v_proj.weight"].T).view(n, kv, hd)
        kk, vv = kk.repeat_interleave(heads // kv, 1), vv.repeat_interleave(heads // kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) / hd**0.5
        scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv).flatten(1)
        h = attn @ w[m + "self_attn.o_proj.weight"].T + states
        y = rms(h, w[m + "post_attention_layernorm.weight"])
        gate, up = y @ w[m + "mlp.gate_proj.weight"].T, y @ w[m + "mlp.up_proj.weight"].T
        prenorm = (torch.nn.functional.silu(gate) * up) @ w[m + "mlp.down_proj.weight"].T + h
        logits = rms(prenorm[-1], w["norm.weight"]) @ w["lm_head.weight"].T
        draft = int(logits.argmax()) + int(w["d2t"][int(logits.argmax())])
        drafts.append(draft)
        ids.append(draft)
        states = torch.cat([states, prenorm[-1:]])
    return drafts


def test_drafts_follow_the_published_forward(tiny_model, tmp_path):
    """The first drafts after a prefill equal EAGLE-3 computed from Hugging Face's hidden
    states of the target (the default aux layers of a 4-layer target: 2, 2, 1)."""
    import json

    import transformers
    from safetensors.torch import load_file

    target = tiny_model("qwen3", num_hidden_layers=4)
    head = write_head(tmp_path, target, aux_layer_ids=None)
    prompt = repetitive_prompts(1)[0]
    eng = engine(target, speculative_config=eagle3(head, k=3))
    proposed = record_drafts(eng)
    run_to_completion(eng, [prompt], greedy(1))
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i][0] for i in (2, 2, 1)], -1)
        tokens = prompt + [int(out.logits[0, -1].argmax())]
        w = {k: v.double() for k, v in load_file(str(head / "model.safetensors")).items()}
        config = json.loads((head / "config.json").read_text())
        embed = hf.get_input_embeddings().weight
        want = reference_eagle3_drafts(w, config, aux, tokens, embed, 3)
    assert proposed[:3] == want


@pytest.mark.gpu
def test_gpu_eagle3_is_lossless(tiny_model, tmp_path):
    """On CUDA (float32, the Triton kernels) greedy output equals no speculation."""
    from kvloom import Engine

    target = tiny_model("qwen3")
    head = write_head(tmp_path, target)
    setting = dict(dtype="float32", device="cuda", block_size=16, progress=False)
    prompts = repetitive_prompts()
    spec = Engine(model=str(target), speculative_config=eagle3(head), **setting)
    outs = run_to_completion(spec, prompts, greedy(24))
    plain = run_to_completion(Engine(model=str(target), **setting), prompts, greedy(24))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert spec.stats()["spec_drafted_tokens"] > 0
