"""kvloom's Qwen3.5 (text, Qwen3_5ForCausalLM) against Hugging Face transformers (its torch
fallback kernels) on a tiny random-weight model, and schedule invariance in float64.

The tiny model has three Gated DeltaNet layers (separate in_proj_qkv / z / b / a, two value
heads per key head) and one gated full-attention layer (GQA, partial rotary through
Qwen3-VL's multimodal rope), dense MLPs everywhere. Weights are drawn with std 0.25 and the
1-D weights (zero-centred norms, the gated norm, A_log, dt_bias) are randomised too.

Teacher-forced logits must match within LOGIT_TOL; greedy continuations of the 8 prompts
batched together must equal transformers' except where transformers' own top-2 margin is
below MARGIN_TOL (reported by assert_batched_greedy_matches).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kvloom import LLM, Engine
from kvloom.workers.cache_pages import pages_for
from tests.conftest import TOKENIZER_FILES, VOCAB
from tests.engine_helpers import PROMPTS, assert_pool_full, greedy, run_to_completion
from tests.oracle_helpers import assert_batched_greedy_matches, kvloom_prompt_logits

# Qwen3_5RMSNorm subclasses Qwen3NextRMSNorm, so one randomiser serves both models.
from tests.test_oracle_qwen3_next import randomise

# fp32 rounding, not a model difference (same reasoning and bound as Qwen3-Next's test:
# the chunked delta rule and the norms after it amplify last-bit differences).
LOGIT_TOL = 5e-4

LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]
TINY_QWEN3_5 = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    layer_types=LAYER_TYPES,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    # rotary over 8 of 16 dims = 4 frequencies, shared by the t/h/w streams as 2/1/1
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=4096,
    bos_token_id=0,
    eos_token_id=2,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, demo_tokenizer_dir):
    out = tmp_path_factory.mktemp("tiny-qwen3_5")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3_5TextConfig(**TINY_QWEN3_5), dtype=torch.float32
    )
    randomise(model)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(demo_tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", progress=False, block_size=16)


def test_checkpoint_layout_and_model_pieces(model_dir, hf_model, llm):
    """What transformers writes: the text-only architecture with `model.layers.N` names and
    the four separate Gated DeltaNet projections; kvloom builds the matching pieces."""
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert type(hf_model).__name__ == "Qwen3_5ForCausalLM"
    names = set(load_file(model_dir / "model.safetensors"))
    for proj in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
        assert f"model.layers.0.linear_attn.{proj}.weight" in names
    assert not any("in_proj_qkvz" in n or "language_model" in n for n in names)
    model = llm.engine.executor.worker.runner.model
    layers = model.model.layers
    assert [layer.kind for layer in layers] == LAYER_TYPES
    assert {type(layer.mlp).__name__ for layer in layers} == {"GatedMLP"}
    assert type(layers[0].linear_attn).__name__ == "GatedDeltaNetSplit"
    assert not hasattr(layers[0].linear_attn, "in_proj_qkvz")
    assert layers[3].self_attn.rotary.rotary_dim == 8  # partial_rotary_factor 0.5 of 16


def test_text_mrope_equals_partial_1d_rope(hf_model, llm):
    """Qwen3-VL's interleaved multimodal rope with the three streams at the same (text)
    position is 1-D rope: same cos/sin as kvloom's table and the same rotated q, k."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    rotary = llm.engine.executor.worker.runner.model.model.layers[3].self_attn.rotary
    hf_rope = hf_model.model.rotary_emb
    positions = torch.tensor([0, 1, 2, 7, 100, 1000, 4095])
    x = torch.zeros(1, len(positions), 64)
    cos, sin = hf_rope(x, positions.view(1, 1, -1).expand(3, 1, -1))
    assert cos.shape[-1] == 8
    ours_cos, ours_sin = rotary.cos[positions], rotary.sin[positions]
    torch.testing.assert_close(cos[0], torch.cat([ours_cos, ours_cos], -1), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[0], torch.cat([ours_sin, ours_sin], -1), rtol=0, atol=1e-6)

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 4, 16, generator=gen)
    k = torch.randn(len(positions), 2, 16, generator=gen)
    ref_q, ref_k = apply_rotary_pos_emb(q[None], k[None], cos, sin, unsqueeze_dim=2)
    ours_q, ours_k = rotary(positions, q, k)
    torch.testing.assert_close(ours_q, ref_q[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours_k, ref_k[0], rtol=0, atol=1e-5)

    # The check has teeth: distinct height/width positions change the interleaved bands.
    spatial = torch.stack([positions, positions + 3, positions + 5]).unsqueeze(1)
    assert not torch.allclose(hf_rope(x, spatial)[0], cos)


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
    print(f"qwen3_5 teacher-forced max |logit diff| per prompt: {errors}")


def test_batched_greedy_matches_transformers(llm, hf_model):
    assert_batched_greedy_matches(llm, hf_model, PROMPTS, "qwen3_5")


def test_multimodal_weight_layout_loads(tmp_path, model_dir, llm):
    """A checkpoint nesting the decoder under `model.language_model.` (with vision and
    MTP tensors beside it) loads to the same model; a stray tensor is named in the error."""
    tensors = load_file(model_dir / "model.safetensors")
    nested = {
        (n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n): t
        for n, t in tensors.items()
    }
    nested["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
    nested["mtp.fc.weight"] = torch.zeros(2, 2)
    out = tmp_path / "nested"
    out.mkdir()
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    save_file(nested, out / "model.safetensors")
    nested_llm = LLM(str(out), dtype="float32", progress=False, block_size=16)
    prompt = PROMPTS[6]
    torch.testing.assert_close(
        kvloom_prompt_logits(nested_llm, prompt), kvloom_prompt_logits(llm, prompt)
    )

    nested["model.language_model.layers.0.linear_attn.in_proj_qkvz.weight"] = torch.zeros(2, 2)
    save_file(nested, out / "model.safetensors")
    with pytest.raises(ValueError, match="in_proj_qkvz"):
        LLM(str(out), dtype="float32", progress=False, block_size=16)


def test_bad_configs_raise_naming_the_field():
    from kvloom.workers.models.qwen3_5 import Qwen3_5ForCausalLM

    with pytest.raises(ValueError, match="text_config"):
        Qwen3_5ForCausalLM({"text_config": dict(TINY_QWEN3_5)}, torch.float32)
    with pytest.raises(ValueError, match="num_experts"):
        Qwen3_5ForCausalLM(dict(TINY_QWEN3_5, num_experts=8), torch.float32)


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


@pytest.mark.parametrize("budget", [5, 4096])
def test_batched_equals_alone_under_token_budgets(model_dir, alone, budget):
    engine = make_engine(model_dir, max_num_batched_tokens=budget)
    outs = run_to_completion(engine, PROMPTS, greedy(24))
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert_pool_full(engine)


def test_preemption_gives_same_tokens(model_dir, alone):
    # Each request needs up to 19 attention blocks of 4 plus its states, each spanning
    # several pages (docs/kv_cache_pages.md); 90 pages cannot hold the 8 together, so the
    # scheduler preempts (recompute).
    engine = make_engine(model_dir, num_kv_blocks=90, enable_prefix_caching=False)
    outs = run_to_completion(engine, PROMPTS, greedy(24))
    assert engine.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert_pool_full(engine)


# ----------------------------------------------------------------------------- TP = 2


def load_rank(model_dir, tp) -> torch.nn.Module:
    """One rank's float64 model with its cache pages, loaded from the checkpoint."""
    from kvloom.workers.models.qwen3_5 import Qwen3_5ForCausalLM
    from kvloom.workers.weight_loader import iterate_checkpoint, load_weights

    config = json.loads((model_dir / "config.json").read_text())
    model = Qwen3_5ForCausalLM(config, torch.float64, tp)
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


def test_tensor_parallel_two_ranks_match_one(model_dir):
    """Each rank takes its key-head groups' slice of every in_proj_qkv part (q, k, v), of
    z, b and a; two ranks give one rank's logits (prefill, resume chunk and decode)."""
    import threading

    from tests.test_oracle_qwen3_next import TP_STEPS, ThreadTPGroup, forward_batch

    def run_steps(model) -> list[torch.Tensor]:
        logits = []
        with torch.inference_mode():
            for rows in TP_STEPS:
                ids, batch = forward_batch(model, rows)
                logits.append(model.compute_logits(model(ids, batch.positions, batch)))
        return logits

    reference = run_steps(load_rank(model_dir, None))
    shared = {"slots": [None, None], "barrier": threading.Barrier(2, timeout=60)}
    ranks = [load_rank(model_dir, ThreadTPGroup(r, 2, shared)) for r in range(2)]
    gdn = ranks[1].model.layers[0].linear_attn
    assert (gdn.num_k_heads, gdn.num_v_heads) == (1, 2)  # half of each
    # in_proj_qkv's parts in the fused in_proj: q, k: 1 head of 16; v: 2 of 8
    assert gdn.in_proj.local_sizes[:3] == [16, 16, 16]
    results: list = [None, None]

    def work(r):
        results[r] = run_steps(ranks[r])

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for rank_logits in results:
        assert rank_logits is not None
        for ours, ref in zip(rank_logits, reference, strict=True):
            torch.testing.assert_close(ours, ref, rtol=0, atol=1e-10)
