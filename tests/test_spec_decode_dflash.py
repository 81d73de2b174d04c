"""The `dflash` drafter: published DFlash block drafters load (config, tensor names and
shapes), bad checkpoints are refused naming what is wrong, the block attention matches a
dense reference, and speculation is lossless on dense and Qwen3-Next targets (float64;
chunked prefill, preemption, prefix hits, async scheduling), an all-sliding drafter
booked as full attention for caching (invariant 4)."""

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

ALL_SLIDING = dict(layer_types=["sliding_attention"] * 2, sliding_window=6)


def target_path(kind, tiny_model, hybrid_model):
    return tiny_model("qwen3") if kind == "dense" else hybrid_model("qwen3_next")


def write_head(tmp_path, target, name="head", **kw):
    from kvloom.workers.spec_decode.dflash import write_dflash_head

    return write_dflash_head(tmp_path / name, target, **kw)


def dflash(head, k: int = 3) -> dict:
    return {"method": "dflash", "model": str(head), "num_speculative_tokens": k}


# -- format ---------------------------------------------------------------------------


def test_published_layout_loads(tiny_model, tmp_path):
    from kvloom.workers.spec_decode.dflash import DFlashProposer

    target = tiny_model("qwen3")
    head = write_head(tmp_path, target, target_layer_ids=[0, 1], **ALL_SLIDING)
    draft = drafter_of(engine(target, speculative_config=dflash(head)))
    assert isinstance(draft, DFlashProposer)
    fmt = draft.format
    assert (fmt.target_layer_ids, fmt.mask_token_id, fmt.block_size) == ([0, 1], 4, 8)
    assert fmt.windows == [6, 6] and fmt.causal == [True, True]  # sliding layers: causal
    # Layer 0's output is captured; the last layer's is the target's final normed state.
    assert draft.points == [1, 2] and draft.capture.points == [1]


def test_layer_attention_follows_the_published_rule():
    from kvloom.workers.spec_decode.dflash import layer_attention

    mixed = {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 5}
    assert [layer_attention(mixed, i, "x") for i in range(2)] == [(None, False), (5, True)]
    forced = {**mixed, "is_causal": False}
    assert layer_attention(forced, 1, "x") == (5, False)
    swa = {"dflash_config": {"use_swa": True, "swa_window_size": 9, "causal": True}}
    assert layer_attention(swa, 0, "x") == (9, True)
    assert layer_attention({}, 0, "x") == (None, False)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"layers.1.self_attn.k_norm.weight": None}, "lacks 1 tensor.*layers.1.self_attn.k_norm"),
        (
            {"fc.weight": torch.zeros(64, 64)},
            r"fc.weight has shape \[64, 64\], expected \[64, 128\]",
        ),
        (
            {"layers.0.mlp.up_proj.weight": torch.zeros(3, 64)},
            r"layers.0.mlp.up_proj.weight has shape",
        ),
        ({"mask_embedding": torch.zeros(64)}, "unexpected tensor.*mask_embedding"),
    ],
    ids=["missing", "misshaped-fc", "misshaped-mlp", "unexpected"],
)
def test_bad_tensors_are_refused_by_name(tiny_model, tmp_path, overrides, message):
    target = tiny_model("qwen3")
    head = write_head(tmp_path, target, target_layer_ids=[0, 1], overrides=overrides)
    with pytest.raises(ValueError, match=message):
        engine(target, speculative_config=dflash(head))


def edit_config(head, **changes):
    import json

    config = json.loads((head / "config.json").read_text())
    for key, value in changes.items():
        if key in ("target_layer_ids", "mask_token_id"):
            config["dflash_config"][key] = value
        else:
            config[key] = value
    (head / "config.json").write_text(json.dumps(config))
    return head


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(hidden_size=32), "hidden_size 32 does not match the target's hidden_size 64"),
        (dict(target_layer_ids=[0, 5]), r"target_layer_ids \[0, 5\] names layers outside"),
        (dict(mask_token_id=512), "mask_token_id must be a token id below 512"),
        (dict(architectures=["DFlash2DraftModel"]), "DFlash2DraftModel .* is not supported"),
        (dict(block_size=3), "num_speculative_tokens 3 exceeds .*block_size 3 - 1"),
    ],
    ids=["hidden", "layer-ids", "mask-token", "dflash2", "block-size"],
)
def test_bad_configs_are_refused_by_field(tiny_model, tmp_path, changes, message):
    target = tiny_model("qwen3")
    head = edit_config(write_head(tmp_path, target, target_layer_ids=[0, 1]), **changes)
    with pytest.raises(ValueError, match=message):
        engine(target, speculative_config=dflash(head))


# -- the block attention against a dense reference ------------------------------------


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "window, causal",
    [(None, False), (None, True), (3, True), (3, False), (13, False), (14, True)],
    ids=str,
)
def test_block_attention_matches_dense_attention_over_context_and_block(window, causal, device):
    """A row at b = 9 with a 4-token block: the paged context part (on CUDA the Triton
    kernel, once per block offset under a window) and the block part, merged, equal one
    masked softmax over all 13 keys (z-lab's mask)."""
    from kvloom.workers.attention_metadata import GroupMetadata
    from kvloom.workers.spec_decode.dflash import BlockRows, DFlashLayer

    torch.manual_seed(0)
    dtype = torch.float64 if device == "cpu" else torch.float32
    config = dict(
        model_type="qwen3",
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    with torch.device(device):
        layer = DFlashLayer(config, 0, window, causal, None, dtype)
    b, n, block_size = 9, 4, 4
    cache = torch.randn(2, 4, block_size, 2, 8, dtype=dtype, device=device)
    layer.attn.kv_cache = cache
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32, device=device)  # positions 0-3, 4-7, 8-11
    lens = torch.tensor([b], dtype=torch.int32, device=device)
    blocks = BlockRows(1, n, lens, b, [GroupMetadata(table, None)], {0: 0})
    q, k, v = (torch.randn(n, h, 8, dtype=dtype, device=device) for h in (4, 2, 2))
    got = layer.attend(q, k, v, blocks).view(n, 4, 8).cpu().double()
    cache, table, q, k, v = (t.cpu() for t in (cache, table, q, k, v))
    cache, q, k, v = (t.double() for t in (cache, q, k, v))

    ctx_pos = torch.arange(b)
    ctx_k = torch.cat([cache[0, table[0, p // block_size], p % block_size][None] for p in ctx_pos])
    ctx_v = torch.cat([cache[1, table[0, p // block_size], p % block_size][None] for p in ctx_pos])
    keys = torch.cat([ctx_k, k]).repeat_interleave(2, dim=1)
    values = torch.cat([ctx_v, v]).repeat_interleave(2, dim=1)
    q_pos, k_pos = b + torch.arange(n), torch.arange(b + n)
    visible = torch.ones(n, b + n, dtype=torch.bool)
    if causal:
        visible &= k_pos[None] <= q_pos[:, None]
    if window is not None:
        visible &= q_pos[:, None] - k_pos[None] < window
        visible &= k_pos[None] - q_pos[:, None] < window
    scores = torch.einsum("qhd,khd->hqk", q, keys) * layer.attn.scale
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    want = torch.einsum("hqk,khd->qhd", probs, values)
    # The paged kernel's log-sum-exp is float32 by contract: the merge is that exact (and
    # on CUDA the inputs are float32 too).
    tol = dict(rtol=1e-5, atol=1e-6) if device == "cpu" else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got, want, **tol)


# -- lossless -------------------------------------------------------------------------


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "all-sliding"])
@pytest.mark.parametrize("kind", ["dense", "qwen3_next"])
def test_dflash_is_lossless_with_chunks_preemption_and_prefix_hits(
    tiny_model, hybrid_model, tmp_path, kind, sliding
):
    target = target_path(kind, tiny_model, hybrid_model)
    head = write_head(tmp_path, target, **(ALL_SLIDING if sliding else {}))
    plain = engine(target)
    spec = engine(
        target, speculative_config=dflash(head), num_kv_blocks=80, max_num_batched_tokens=16
    )
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
    kinds = {type(g.spec).__name__ for g in spec.kv_cache.groups}
    assert "SlidingWindowSpec" not in kinds  # an all-sliding drafter is booked as full
    assert_pool_full(spec)


@pytest.mark.parametrize("kind", ["dense", "qwen3_next"])
def test_seeded_sampling_with_dflash_equals_no_speculation(
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
    spec = engine(target, speculative_config=dflash(write_head(tmp_path, target, **ALL_SLIDING)))
    outs = run_to_completion(spec, prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert spec.stats()["spec_drafted_tokens"] > 0


@pytest.mark.parametrize("kind", ["dense", "qwen3_next"])
def test_async_dflash_matches_the_synchronous_engine(tiny_model, hybrid_model, tmp_path, kind):
    target = target_path(kind, tiny_model, hybrid_model)
    head = write_head(tmp_path, target, **ALL_SLIDING)
    hybrid = kind == "qwen3_next"
    setting = dict(
        speculative_config=dflash(head),
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


def reference_dflash_drafts(w, config, context, tokens, embed, lm_head, k, window, causal):
    """z-lab's DFlashDraftModel forward: the block [x_T, mask × k] at positions T..T+k,
    each layer's keys/values over the context vectors and the block, z-lab's mask."""
    from tests.test_spec_decode_eagle3 import rms, rope

    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    theta = config["rope_parameters"]["rope_theta"]
    t = context.shape[0]
    ctx = rms(context @ w["fc.weight"].T, w["hidden_norm.weight"])
    block = [tokens[-1]] + [config["dflash_config"]["mask_token_id"]] * k
    h = embed[torch.tensor(block)]
    q_pos, k_pos = torch.arange(t, t + k + 1), torch.arange(t + k + 1)
    visible = torch.ones(k + 1, t + k + 1, dtype=torch.bool)
    if causal:
        visible &= k_pos[None] <= q_pos[:, None]
    if window is not None:
        visible &= q_pos[:, None] - k_pos[None] < window
        if not causal:
            visible &= k_pos[None] - q_pos[:, None] < window
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        hn = rms(h, w[p + "input_layernorm.weight"])
        both = torch.cat([ctx, hn])
        q = (hn @ w[p + "self_attn.q_proj.weight"].T).view(k + 1, heads, hd)
        q = rope(rms(q, w[p + "self_attn.q_norm.weight"]), q_pos, theta)
        kk = (both @ w[p + "self_attn.k_proj.weight"].T).view(t + k + 1, kv, hd)
        kk = rope(rms(kk, w[p + "self_attn.k_norm.weight"]), k_pos, theta)
        vv = (both @ w[p + "self_attn.v_proj.weight"].T).view(t + k + 1, kv, hd)
        kk, vv = kk.repeat_interleave(heads // kv, 1), vv.repeat_interleave(heads // kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) / hd**0.5
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        h = (
            torch.einsum("hqk,khd->qhd", probs, vv).flatten(1) @ w[p + "self_attn.o_proj.weight"].T
            + h
        )
        y = rms(h, w[p + "post_attention_layernorm.weight"])
        gate, up = y @ w[p + "mlp.gate_proj.weight"].T, y @ w[p + "mlp.up_proj.weight"].T
        h = (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T + h
    logits = rms(h, w["norm.weight"])[1:] @ lm_head.T
    return logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "setting", [dict(), dict(ALL_SLIDING, sliding_window=5)], ids=["full-noncausal", "sliding"]
)
def test_drafts_follow_the_published_forward(tiny_model, tmp_path, setting):
    """The first drafts after a prefill equal z-lab's forward computed from Hugging
    Face's hidden states of the target (layer 1 of 2: its final normed state), with a
    window that reaches into the context."""
    import json

    import transformers
    from safetensors.torch import load_file

    target = tiny_model("qwen3")
    head = write_head(tmp_path, target, target_layer_ids=[0, 1], **setting)
    prompt = repetitive_prompts(1)[0]
    eng = engine(target, speculative_config=dflash(head, k=3))
    draft = drafter_of(eng)
    proposed = []
    run = draft.run
    draft.run = lambda step: proposed.append(run(step)) or proposed[-1]
    run_to_completion(eng, [prompt], greedy(1))
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
        context = torch.cat([out.hidden_states[i][0] for i in (1, 2)], -1)
        tokens = prompt + [int(out.logits[0, -1].argmax())]
        w = {k: v.double() for k, v in load_file(str(head / "model.safetensors")).items()}
        config = json.loads((head / "config.json").read_text())
        want = reference_dflash_drafts(
            w,
            config,
            context,
            tokens,
            hf.get_input_embeddings().weight,
            hf.get_output_embeddings().weight,
            3,
            draft.format.windows[0],
            draft.format.causal[0],
        )
    assert list(proposed[0].values()) == [want]


@pytest.mark.gpu
def test_gpu_dflash_all_sliding_is_lossless(tiny_model, tmp_path):
    """On CUDA (float32, the Triton kernels: the context part runs once per block offset
    under the window) greedy output equals no speculation."""
    from kvloom import Engine

    target = tiny_model("qwen3")
    head = write_head(tmp_path, target, **ALL_SLIDING)
    setting = dict(dtype="float32", device="cuda", block_size=16, progress=False)
    prompts = repetitive_prompts()
    spec = Engine(model=str(target), speculative_config=dflash(head), **setting)
    outs = run_to_completion(spec, prompts, greedy(24))
    plain = run_to_completion(Engine(model=str(target), **setting), prompts, greedy(24))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert spec.stats()["spec_drafted_tokens"] > 0
