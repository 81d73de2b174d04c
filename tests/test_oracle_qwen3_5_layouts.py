"""Qwen3.5 as published: the multimodal `Qwen3_5ForConditionalGeneration` and
`Qwen3_5MoeForConditionalGeneration` checkpoints (text_config nested in config.json, text
weights under `model.language_model.`, a vision tower under `model.visual.`) load as
kvloom's Qwen3.5 text model and match transformers' model on text (teacher-forced logits,
fp32) on tiny random weights. The MoE checkpoint also loads from the 3-D expert tensors
some published checkpoints hold, with MTP tensors beside them.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kvloom import LLM
from tests.conftest import TOKENIZER_FILES, VOCAB
from tests.engine_helpers import PROMPTS, greedy
from tests.oracle_helpers import kvloom_prompt_logits
from tests.test_oracle_qwen3_5 import LOGIT_TOL, TINY_QWEN3_5

MOE = dict(
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_experts=4,
    num_experts_per_tok=2,
)
TINY_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    num_position_embeddings=16,
    patch_size=4,
)
KINDS = {
    "dense": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", {}),
    "moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", MOE),
}


def randomise(model: torch.nn.Module) -> None:
    """std-0.25 matrices (the 3-D expert stacks included), random zero-centred norms
    (both models' RMSNorm classes), gated-norm weights, A_log and dt_bias."""
    gen = torch.Generator().manual_seed(4321)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.visual."):
                continue
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.25)
            elif name.endswith("linear_attn.norm.weight"):  # gated norm: plain w
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.3)
            elif name.endswith("norm.weight"):  # zero-centred: (1 + w)
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 4, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def build(kind: str, out, tokenizer_dir):
    config_name, model_name, extra = KINDS[kind]
    text = {k: v for k, v in TINY_QWEN3_5.items() if k not in ("bos_token_id", "eos_token_id")}
    config = getattr(transformers, config_name)(
        text_config={**text, **extra}, vision_config=TINY_VISION
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(torch.float32)
    randomise(model)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(KINDS))
def checkpoint(request, tmp_path_factory, demo_tokenizer_dir):
    out = tmp_path_factory.mktemp(f"qwen3_5-{request.param}-cg")
    return request.param, out, build(request.param, out, demo_tokenizer_dir)


def test_layout_is_the_published_one(checkpoint):
    kind, out, _ = checkpoint
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [KINDS[kind][1]]
    assert "text_config" in config and "hidden_size" not in config
    names = set(load_file(out / "model.safetensors"))
    assert any(n.startswith("model.visual.") for n in names)
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in names
    assert not any(n.startswith("model.layers.") for n in names)
    if kind == "moe":
        assert "model.language_model.layers.0.mlp.experts.3.down_proj.weight" in names


def test_teacher_forced_logits_match_transformers(checkpoint, caplog):
    kind, out, hf_model = checkpoint
    with caplog.at_level(logging.INFO, logger="kvloom.workers.weight_loader"):
        llm = LLM(str(out), dtype="float32", progress=False, block_size=16)
    skipped = [r.getMessage() for r in caplog.records if "model.visual." in r.getMessage()]
    assert len(skipped) == 1, skipped  # one line for the whole vision tower
    model = llm.engine.executor.worker.runner.model
    mlp_kinds = {type(layer.mlp).__name__ for layer in model.model.layers}
    assert mlp_kinds == ({"Qwen3NextSparseMoe"} if kind == "moe" else {"GatedMLP"})
    errors = []
    for prompt in (PROMPTS[3], list(range(3, 70))):
        ours = kvloom_prompt_logits(llm, prompt)
        with torch.no_grad():
            ref = hf_model(input_ids=torch.tensor([prompt])).logits[0]
        assert ref.shape == (len(prompt), VOCAB) and ref.abs().max() > 1.0
        err = (ours - ref).abs().max().item()
        errors.append(err)
        assert err <= LOGIT_TOL, f"{kind}: max |logit diff| {err:.3g} over {len(prompt)} tokens"
    print(f"qwen3_5 {kind} conditional-generation max |logit diff| per prompt: {errors}")
    out_tokens = llm.generate([{"prompt_token_ids": PROMPTS[0]}], greedy(4))
    assert len(out_tokens[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("checkpoint", ["moe"], indirect=True)
def test_fused_3d_experts_and_mtp_load_the_same_model(checkpoint, tmp_path):
    """Experts stored as `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I]
    with `mtp.*` tensors beside them give the per-expert checkpoint's logits; a stack with
    the wrong rank is named in the error."""
    _, out, _ = checkpoint
    tensors = load_file(out / "model.safetensors")
    fused: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if ".experts." not in name:
            fused[name] = t
    for layer in range(TINY_QWEN3_5["num_hidden_layers"]):
        base = f"model.language_model.layers.{layer}.mlp.experts"
        experts = range(MOE["num_experts"])
        fused[f"{base}.gate_up_proj"] = torch.stack(
            [
                torch.cat(
                    [tensors[f"{base}.{e}.gate_proj.weight"], tensors[f"{base}.{e}.up_proj.weight"]]
                )
                for e in experts
            ]
        )
        fused[f"{base}.down_proj"] = torch.stack(
            [tensors[f"{base}.{e}.down_proj.weight"] for e in experts]
        )
    fused["mtp.fc.weight"] = torch.zeros(2, 2)
    fused["mtp.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(3)  # ignored: any shape
    target = tmp_path / "fused"
    target.mkdir()
    for f in out.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, target / f.name)
    save_file(fused, target / "model.safetensors")
    prompt = PROMPTS[5]
    reference = kvloom_prompt_logits(LLM(str(out), dtype="float32", progress=False), prompt)
    ours = kvloom_prompt_logits(LLM(str(target), dtype="float32", progress=False), prompt)
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)

    fused["model.language_model.layers.0.mlp.experts.down_proj"] = torch.zeros(4, 64)
    save_file(fused, target / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts\.down_proj"):
        LLM(str(target), dtype="float32", progress=False)


def test_moe_config_without_experts_is_named():
    from kvloom.workers.models.qwen3_5 import Qwen3_5MoeForCausalLM

    with pytest.raises(ValueError, match="num_experts_per_tok"):
        Qwen3_5MoeForCausalLM({**TINY_QWEN3_5, **MOE, "num_experts_per_tok": None}, torch.float32)


@pytest.mark.parametrize("checkpoint", ["dense"], indirect=True)
def test_top_level_tie_word_embeddings_applies_to_the_text_model(checkpoint, tmp_path):
    """A multimodal config that says tie_word_embeddings only at the top level, with no
    lm_head tensor: the text model's LM head is the embedding (and without the flag, the
    missing tensor is named)."""
    _, out, _ = checkpoint
    tensors = load_file(out / "model.safetensors")
    del tensors["lm_head.weight"]
    config = json.loads((out / "config.json").read_text())
    config["text_config"].pop("tie_word_embeddings", None)
    config["tie_word_embeddings"] = True
    for f in out.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, tmp_path / f.name)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = LLM(str(tmp_path), dtype="float32", progress=False).engine.executor.worker.runner.model
    embed = tensors["model.language_model.embed_tokens.weight"]
    torch.testing.assert_close(model.lm_head.weight.data, embed, rtol=0, atol=0)
    config["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="lm_head.weight"):
        LLM(str(tmp_path), dtype="float32", progress=False)
