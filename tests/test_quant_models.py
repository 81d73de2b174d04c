"""Quantized checkpoints end to end on the CPU (the torch references serve them).

Each tiny checkpoint is written in a published layout (tests/quant_checkpoints.py: tensor
names, dtypes, scale shapes and `quantization_config` as Qwen's FP8 releases, llm-
compressor's FP8 and Kimi's INT4 checkpoints have them; int4 packing by compressed-
tensors itself). The oracle is Hugging Face transformers on the *dequantized* weights:

* W4A16 (float activations): kvloom's logits equal the dequantized model's to float32
  rounding (atol 1e-4 on logits of magnitude ~10; measured ~1e-5).
* FP8 (activations quantized at run time): the oracle's linear layers and experts also
  quantize their inputs to e4m3 and back, per token and 128-group (block) or per token
  (channel / tensor): atol 1e-4 (measured <= 1.4e-5). Without that fake quantization the
  difference is the FP8 activation error itself (~1 logit here), which this bound would
  catch as well as any scale read wrongly (a 2x scale error moves logits by ~10).

An e4m3 rounding boundary can make a single activation element round to its neighbour in
one model and not the other (float32 differences of 1e-7 decide it), and attention or a
recurrent state carries that difference to later positions. In the dense models no such
event occurs for this prompt. In the FP8 MoE hybrid the logits differ by up to 6.2e-3
(block scales) in float64, and in float32 where the CPU's sgemm is AVX2's, but by 8.9e-2
in float32 on an AVX-512 machine, where float32 rounding flips more elements. So FP8 on the
hybrid runs in float64, whose figure does not depend on the CPU, held to FLIP_ATOL = 2e-2:
still 50x below the error of FP8 activations themselves, and far below any scale misread.
Greedy tokens must equal the oracle's except at its near-ties (oracle_helpers).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kvloom import LLM
from tests.conftest import TOKENIZER_FILES, VOCAB, build_hf_model
from tests.oracle_helpers import MARGIN_TOL, hf_greedy, kvloom_prompt_logits
from tests.quant_checkpoints import (
    AWQ_SCHEMES,
    GPTQ_ASYM_SCHEMES,
    GPTQ_SCHEMES,
    fake_quant_fp8_experts,
    fake_quant_fp8_inputs,
    write_dequantized,
    write_quantized,
)

PROMPT = [5, 17, 42, 99, 3, 250, 77, 12, 300, 8, 64, 128, 31, 9, 400, 2]
ATOL = 1e-4
FLIP_ATOL = 2e-2
DENSE_SCHEMES = ("fp8_block", "fp8_channel", "fp8_tensor", "w4a16_g32", "w4a16_g128")
MOE_SCHEMES = ("fp8_block", "fp8_channel", "w4a16_g32", "w4a16_g128")
GROUPS = {"fp8_block": 128, "fp8_channel": None, "fp8_tensor": None}


@pytest.fixture(scope="module")
def dense_src(tmp_path_factory, demo_tokenizer_dir) -> Path:
    """Qwen3 with 128-wide layers, so 128-blocks and 128-groups fit (k/v rows are 64:
    a partial block, as real checkpoints have at odd sizes)."""
    out = tmp_path_factory.mktemp("quant-qwen3")
    return build_hf_model(
        "qwen3", out, demo_tokenizer_dir, hidden_size=128, intermediate_size=256,
        head_dim=32, num_key_value_heads=2,
    )  # fmt: skip


@pytest.fixture(scope="module")
def moe_src(tmp_path_factory, demo_tokenizer_dir) -> Path:
    """Qwen3-Next: one Gated DeltaNet and one gated-attention layer, each with 4 experts
    (top-2) and a shared expert."""
    out = tmp_path_factory.mktemp("quant-qwen3-next")
    config = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
        shared_expert_intermediate_size=128, max_position_embeddings=4096, bos_token_id=0,
        eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(2)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(demo_tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def qwen3_5_src(tmp_path_factory, demo_tokenizer_dir) -> Path:
    """Qwen3.5 (64 wide): in_proj_qkv is one checkpoint tensor of three parts."""
    from tests.test_oracle_qwen3_5 import TINY_QWEN3_5
    from tests.test_oracle_qwen3_next import randomise

    out = tmp_path_factory.mktemp("quant-qwen3_5")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3_5TextConfig(**TINY_QWEN3_5), dtype=torch.float32
    )
    randomise(model)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(demo_tokenizer_dir / name, out / name)
    return out


def make_pair(src: Path, tmp: Path, scheme: str, block=(128, 128)) -> tuple[Path, Path]:
    quantized = write_quantized(src, tmp / "q", scheme, block)
    return quantized, write_dequantized(src, tmp / "d", scheme, block)


def oracle(dequantized: Path, scheme: str, group: int | None = None, dtype=torch.float32):
    model = transformers.AutoModelForCausalLM.from_pretrained(dequantized, dtype=dtype)
    if scheme.startswith("fp8"):
        fake_quant_fp8_inputs(model, group or GROUPS[scheme])
        fake_quant_fp8_experts(model, group or GROUPS[scheme])
    return model.eval()


def llm(path: Path, dtype="float32", **kwargs) -> LLM:
    return LLM(model=str(path), dtype=dtype, num_kv_blocks=64, max_model_len=256, **kwargs)


def check_against_oracle(
    quantized: Path, dequantized: Path, scheme: str, atol=ATOL, group=None, dtype=torch.float32
) -> None:
    ref_model = oracle(dequantized, scheme, group, dtype)
    engine = llm(quantized, str(dtype).removeprefix("torch."))
    ours = kvloom_prompt_logits(engine, PROMPT)
    with torch.no_grad():
        ref = ref_model(torch.tensor([PROMPT])).logits[0]
    err = (ours - ref).abs().max().item()
    print(f"ERRNORM {scheme}: max |logit diff| {err:.3g} (logits up to {ref.abs().max():.3g})")
    assert err <= atol, f"{scheme}: max |logit diff| vs the dequantized oracle {err:.3g}"
    steps = 8
    tokens = engine.generate([{"prompt_token_ids": PROMPT}], greedy_params(steps))
    ref_tokens, margins = hf_greedy(ref_model, PROMPT, steps)
    for pos, (a, b) in enumerate(zip(tokens[0].outputs[0].token_ids, ref_tokens)):
        if a != b:
            assert margins[pos] < MARGIN_TOL, f"{scheme}: greedy step {pos}: {a} vs {b}"
            break


def greedy_params(steps: int):
    from kvloom import SamplingParams

    return SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("scheme", DENSE_SCHEMES)
def test_dense_checkpoint_matches_dequantized_oracle(dense_src, tmp_path, scheme):
    check_against_oracle(*make_pair(dense_src, tmp_path, scheme), scheme)


@pytest.mark.parametrize("scheme", ["fp8_channel", "fp8_tensor", "w4a16_g32", "w4a16_g128"])
def test_compressed_tensors_reads_the_same_checkpoint(dense_src, tmp_path, scheme):
    """The format's own library as the oracle: transformers with compressed-tensors loads
    the *quantized* checkpoint itself (its decompression, its activation quantization for
    FP8), and kvloom's logits equal its."""
    quantized = write_quantized(dense_src, tmp_path / "q", scheme)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.float32)
    with torch.no_grad():
        ref = ref_model(torch.tensor([PROMPT])).logits[0]
    ours = kvloom_prompt_logits(llm(quantized), PROMPT)
    err = (ours - ref).abs().max().item()
    print(f"ERRNORM compressed-tensors {scheme}: max |logit diff| {err:.3g}")
    assert err <= ATOL, f"{scheme}: max |logit diff| vs compressed-tensors {err:.3g}"


@pytest.mark.parametrize("scheme", MOE_SCHEMES)
def test_moe_hybrid_checkpoint_matches_dequantized_oracle(moe_src, tmp_path, scheme):
    # FP8 in float64 (see the module docstring); W4A16 has no rounding boundary to meet, and
    # transformers' grouped expert matmul takes no float64.
    fp8 = scheme.startswith("fp8")
    dtype = torch.float64 if fp8 else torch.float32
    pair = make_pair(moe_src, tmp_path, scheme)
    check_against_oracle(*pair, scheme, FLIP_ATOL if fp8 else ATOL, dtype=dtype)


@pytest.mark.parametrize("scheme", ["fp8_block", "w4a16_g32"])
def test_qwen3_5_split_projections_match_dequantized_oracle(qwen3_5_src, tmp_path, scheme):
    """16 x 32 FP8 blocks (64-wide layers): in_proj_qkv's one tensor is cut into its
    q / k / v parts (32 rows each) along block rows. (With 32 x 32 blocks this prompt
    meets e4m3 rounding-boundary events, up to 8e-2 at single positions, because the
    chunked delta rule already differs from transformers' by ~1e-5 in float32.)"""
    pair = make_pair(qwen3_5_src, tmp_path, scheme, block=(16, 32))
    check_against_oracle(*pair, scheme, group=32 if scheme == "fp8_block" else None)


def test_asymmetric_compressed_tensors_int4_matches_dequantized_oracle(dense_src, tmp_path):
    """pack-quantized with `symmetric: false`: weight_zero_point packed along N (written and
    unpacked for the oracle by compressed-tensors itself) becomes per-group offsets."""
    check_against_oracle(*make_pair(dense_src, tmp_path, "w4a16_asym_g32"), "w4a16_asym_g32")


def test_asymmetric_compressed_tensors_int4_moe_matches_dequantized_oracle(moe_src, tmp_path):
    quantized, dequantized = make_pair(moe_src, tmp_path, "w4a16_asym_g32")
    check_against_oracle(quantized, dequantized, "w4a16_asym_g32")
    layer = llm(quantized).engine.executor.worker.runner.model.model.layers[0]
    assert layer.mlp.experts.gate_up.quant_method.scheme.name == "w4a16-g32-zp"


@pytest.mark.parametrize("scheme", GPTQ_SCHEMES + GPTQ_ASYM_SCHEMES)
def test_gptq_dense_checkpoint_matches_dequantized_oracle(dense_src, tmp_path, scheme):
    """GPTQ (no activation order) runs on the W4A16 kernels: its qweight and scales
    transposed are pack-quantized's tensors (workers/layers/quantization/int4_layouts.py);
    an asymmetric one (sym: false) adds AWQ's per-group zero-point offsets."""
    check_against_oracle(*make_pair(dense_src, tmp_path, scheme), scheme)


def test_asymmetric_gptq_moe_hybrid_checkpoint_matches_dequantized_oracle(moe_src, tmp_path):
    """Zero points in the experts (the fused MoE's offsets) and in the dense projections."""
    quantized, dequantized = make_pair(moe_src, tmp_path, "gptq_asym_g32")
    check_against_oracle(quantized, dequantized, "gptq_asym_g32")
    layer = llm(quantized).engine.executor.worker.runner.model.model.layers[0]
    assert layer.mlp.experts.gate_up.quant_method.scheme.name == "w4a16-g32-zp"


def test_gptq_moe_hybrid_checkpoint_matches_dequantized_oracle(moe_src, tmp_path):
    """Experts, shared expert, Gated DeltaNet and attention projections in GPTQ; the router,
    shared-expert gate and in_proj_ba have no qweight, so they stay float."""
    quantized, dequantized = make_pair(moe_src, tmp_path, "gptq_g32")
    check_against_oracle(quantized, dequantized, "gptq_g32")
    layer = llm(quantized).engine.executor.worker.runner.model.model.layers[0]
    assert layer.mlp.experts.gate_up.quant_method.scheme.name == "w4a16-g32"
    for module in (layer.mlp.gate, layer.mlp.shared_expert_gate, layer.linear_attn.in_proj_ba):
        assert module.quant_method is None and module.weight.dtype == torch.float32


@pytest.mark.parametrize("scheme", AWQ_SCHEMES)
def test_awq_dense_checkpoint_matches_dequantized_oracle(dense_src, tmp_path, scheme):
    """AWQ (zero points 0..15): the symmetric W4A16 kernels plus a per-group zero-point
    correction (W4A16ZeroPointMethod) give the dequantized model's logits."""
    check_against_oracle(*make_pair(dense_src, tmp_path, scheme), scheme)


def test_awq_moe_hybrid_checkpoint_matches_dequantized_oracle(moe_src, tmp_path):
    """AWQ experts: the fused MoE kernels dequantize q * s - s * z in their tiles."""
    quantized, dequantized = make_pair(moe_src, tmp_path, "awq_g32")
    check_against_oracle(quantized, dequantized, "awq_g32")
    experts = llm(quantized).engine.executor.worker.runner.model.model.layers[0].mlp.experts
    assert experts.gate_up.quant_method.scheme.name == "w4a16-g32-zp"
    assert experts.down.weight_offset.dtype == torch.float32


def test_w4a16_equals_kvloom_float_on_dequantized_weights(moe_src, tmp_path):
    """Float activations: the int4 path is the float path on the dequantized weights."""
    quantized, dequantized = make_pair(moe_src, tmp_path, "w4a16_g32")
    ours = kvloom_prompt_logits(llm(quantized), PROMPT)
    ref = kvloom_prompt_logits(llm(dequantized), PROMPT)
    assert (ours - ref).abs().max().item() <= 1e-5


def test_layers_get_the_checkpoint_schemes(moe_src, tmp_path):
    quantized, _ = make_pair(moe_src, tmp_path, "fp8_block")
    model = llm(quantized).engine.executor.worker.runner.model
    layer = model.model.layers[0]
    assert layer.linear_attn.in_proj_qkvz.weight.dtype == torch.float8_e4m3fn
    assert layer.linear_attn.in_proj_qkvz.weight_scale_inv.dtype == torch.float32
    assert layer.mlp.experts.gate_up.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.shared_expert.down_proj.quant_method.scheme.name == "fp8-block128x128"
    # modules_to_not_convert: router, shared-expert gate, in_proj_ba, lm_head stay float.
    for module in (layer.mlp.gate, layer.mlp.shared_expert_gate, layer.linear_attn.in_proj_ba):
        assert module.quant_method is None and module.weight.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.float32


# ---------------------------------------------------------------- bad checkpoints


def edit_tensors(path: Path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_scale_names_the_tensor(dense_src, tmp_path):
    quantized = write_quantized(dense_src, tmp_path / "q", "fp8_block")
    edit_tensors(quantized, lambda t: t.pop("model.layers.1.mlp.down_proj.weight_scale_inv"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight_scale_inv"):
        llm(quantized)


def test_wrong_group_size_names_the_tensor(dense_src, tmp_path):
    """The config says group 128, the tensors were written with group 32."""

    def claim_128(cfg):
        cfg["config_groups"]["group_0"]["weights"]["group_size"] = 128
        return cfg

    quantized = write_quantized(dense_src, tmp_path / "q", "w4a16_g32", config_edit=claim_128)
    expected = r"layers\.\d+\.\w+\.\w+_proj\.weight_scale: .*\(w4a16-g128\): expected shape"
    with pytest.raises(ValueError, match=expected):
        llm(quantized)


def test_float_weight_where_fp8_is_declared(dense_src, tmp_path):
    quantized = write_quantized(dense_src, tmp_path / "q", "fp8_channel")
    name = "model.layers.0.self_attn.o_proj.weight"
    edit_tensors(quantized, lambda t: t.__setitem__(name, t[name].float()))
    with pytest.raises(ValueError, match=r"o_proj\.weight.*expected dtype float8_e4m3fn"):
        llm(quantized)


def test_quantized_tensor_in_a_module_left_float(dense_src, tmp_path):
    """modules_to_not_convert names a module whose tensor the checkpoint stores in FP8."""

    def ignore_o_proj(cfg):
        cfg["modules_to_not_convert"] = cfg["modules_to_not_convert"] + ["o_proj"]
        return cfg

    quantized = write_quantized(dense_src, tmp_path / "q", "fp8_block", config_edit=ignore_o_proj)
    with pytest.raises(ValueError, match=r"o_proj.*float8_e4m3fn.*leaves this module unquantized"):
        llm(quantized)


def test_float_tensor_where_the_config_quantizes(dense_src, tmp_path):
    """The config quantizes every Linear, the checkpoint keeps one of them float."""
    quantized = write_quantized(dense_src, tmp_path / "q", "w4a16_g32")
    name = "model.layers.0.mlp.down_proj"

    def keep_float(tensors):
        for suffix in ("weight_packed", "weight_scale", "weight_shape"):
            tensors.pop(f"{name}.{suffix}")
        tensors[f"{name}.weight"] = torch.zeros(128, 256)

    edit_tensors(quantized, keep_float)
    with pytest.raises(ValueError, match=rf"{name}\.weight: .*w4a16-g32.*float weight"):
        llm(quantized)


def test_fused_parts_quantized_differently(dense_src, tmp_path):
    def ignore_k_proj(cfg):
        cfg["ignore"] = cfg["ignore"] + ["re:.*k_proj$"]
        return cfg

    quantized = write_quantized(dense_src, tmp_path / "q", "w4a16_g32", config_edit=ignore_k_proj)
    with pytest.raises(ValueError, match=r"parts of model\.layers\.0\.self_attn\.qkv_proj"):
        llm(quantized)


@pytest.mark.parametrize(
    ("scheme", "edit", "field"),
    [
        ("fp8_block", {"quant_method": "hqq"}, "quant_method"),
        ("fp8_block", {"activation_scheme": "static"}, "activation_scheme"),
        ("fp8_block", {"weight_block_size": [128, 100]}, "weight_block_size"),
        ("fp8_block", {"weight_block_size": None}, "weight_block_size"),
        ("fp8_block", {"fmt": "e5m2"}, "fmt"),
        ("fp8_block", {"scale_fmt": "ue8m0"}, "scale_fmt"),
        ("w4a16_g32", {"format": "marlin-24"}, "format"),
        ("w4a16_g32", {"quantization_status": "frozen"}, "quantization_status"),
        ("fp8_channel", {"weights": {"symmetric": False}}, "weights.symmetric"),
        ("w4a16_g32", {"weights": {"symmetric": "no"}}, "weights.symmetric"),
        ("w4a16_g32", {"weights": {"actorder": "group"}}, "weights.actorder"),
        ("w4a16_g32", {"weights": {"group_size": 256}}, "weights.group_size"),
        ("w4a16_g32", {"weights": {"num_bits": 8}}, "weights"),
        ("fp8_channel", {"input_activations": None}, "input_activations"),
        ("fp8_channel", {"weights": {"strategy": "group"}}, "weights.strategy"),
    ],
)
def test_unsupported_config_names_the_field(dense_src, tmp_path, scheme, edit, field):
    def apply(cfg):
        group = cfg.get("config_groups", {}).get("group_0")
        for key, value in edit.items():
            if key == "weights":
                group["weights"].update(value)
            elif key == "input_activations":
                group[key] = value
            else:
                cfg[key] = value
        return cfg

    quantized = write_quantized(dense_src, tmp_path / "q", scheme, config_edit=apply)
    with pytest.raises(
        ValueError, match=rf"quantization_config\.(config_groups\.group_0\.)?{field}"
    ):
        llm(quantized)


GPTQ_DOWN = "model.layers.1.mlp.down_proj"


def _asymmetric(tensors):
    zeros = tensors[f"{GPTQ_DOWN}.qzeros"]
    zeros[1, 0] = zeros[1, 0] + 1  # column 0 of group 1: zero point 8 + 1


def _reordered(tensors):
    g_idx = tensors[f"{GPTQ_DOWN}.g_idx"]
    tensors[f"{GPTQ_DOWN}.g_idx"] = g_idx.flip(0).contiguous()


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_asymmetric, rf"{GPTQ_DOWN}\.qzeros: group 1, column 0 stores zero point 8 .* stores 7"),
        (_reordered, rf"{GPTQ_DOWN}\.g_idx: input features are reordered"),
        (lambda t: t.pop(f"{GPTQ_DOWN}.qzeros"), rf"{GPTQ_DOWN}\.qzeros: missing"),
        (lambda t: t.pop(f"{GPTQ_DOWN}.scales"), rf"{GPTQ_DOWN}\.scales: missing"),
    ],
)
def test_bad_gptq_tensors_name_the_tensor(dense_src, tmp_path, edit, match):
    quantized = write_quantized(dense_src, tmp_path / "q", "gptq_g32")
    edit_tensors(quantized, edit)
    with pytest.raises(ValueError, match=match):
        llm(quantized)


@pytest.mark.parametrize(
    ("scheme", "edit", "field"),
    [
        ("gptq_g32", {"bits": 8}, "bits"),
        ("gptq_g32", {"sym": None}, "sym"),
        ("gptq_g32", {"desc_act": True}, "desc_act"),
        ("gptq_g32", {"group_size": -1}, "group_size"),
        ("gptq_g32", {"checkpoint_format": "marlin"}, "checkpoint_format"),
        ("gptq_g32", {"lm_head": True}, "lm_head"),
        ("gptq_g32", {"dynamic": {"-:.*down_proj": {}}}, "dynamic"),
        ("awq_g32", {"zero_point": False}, "zero_point"),
        ("awq_g32", {"version": "gemv"}, "version"),
        ("awq_g32", {"bits": 8}, "bits"),
    ],
)
def test_unsupported_int4_config_names_the_field(dense_src, tmp_path, scheme, edit, field):
    quantized = write_quantized(
        dense_src, tmp_path / "q", scheme, config_edit=lambda cfg: {**cfg, **edit}
    )
    with pytest.raises(ValueError, match=rf"quantization_config\.{field} must be"):
        llm(quantized)


def test_gptq_group_size_other_than_the_tensors_names_the_tensor(dense_src, tmp_path):
    """The config says group 128, the tensors were written with group 32."""
    quantized = write_quantized(
        dense_src, tmp_path / "q", "gptq_g32", config_edit=lambda cfg: {**cfg, "group_size": 128}
    )
    with pytest.raises(ValueError, match=r"_proj\.(scales|g_idx): "):
        llm(quantized)


def test_awq_missing_zeros_names_the_tensor(dense_src, tmp_path):
    quantized = write_quantized(dense_src, tmp_path / "q", "awq_g32")
    edit_tensors(quantized, lambda t: t.pop(f"{GPTQ_DOWN}.qzeros"))
    with pytest.raises(ValueError, match=rf"{GPTQ_DOWN}\.qzeros: missing from the AWQ"):
        llm(quantized)


def test_config_field_is_the_checkpoints(dense_src, tmp_path):
    from kvloom.contracts.config import ModelConfig

    quantized = write_quantized(dense_src, tmp_path / "q", "w4a16_g128")
    config = json.loads((quantized / "config.json").read_text())
    assert ModelConfig(str(quantized)).quantization == config["quantization_config"]
    assert ModelConfig(str(dense_src)).quantization is None


def test_compressed_tensors_fp8_blocks(dense_src, tmp_path):
    """compressed-tensors' FP8 block scheme: the same blocks as quant_method "fp8", the
    scale named `weight_scale`; compressed-tensors itself is the oracle."""

    def block_scheme(cfg):
        group = {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                        "block_structure": [128, 128], "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                  "strategy": "group", "group_size": 128, "dynamic": True},
            "output_activations": None,
        }  # fmt: skip
        ignore = ["lm_head", "re:.*embed_tokens$"]
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "quantization_status": "compressed", "config_groups": {"group_0": group},
                "ignore": ignore}  # fmt: skip

    quantized = write_quantized(dense_src, tmp_path / "q", "fp8_block", config_edit=block_scheme)

    def rename(tensors):
        for name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
            tensors[name[: -len("_inv")]] = tensors.pop(name).float()

    edit_tensors(quantized, rename)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.float32)
    with torch.no_grad():
        ref = ref_model(torch.tensor([PROMPT])).logits[0]
    ours = kvloom_prompt_logits(llm(quantized), PROMPT)
    err = (ours - ref).abs().max().item()
    print(f"ERRNORM compressed-tensors fp8 blocks: max |logit diff| {err:.3g}")
    assert err <= ATOL


def test_kimi_linear_int4_experts(tmp_path):
    """Kimi's INT4 layout on Kimi-Linear: only the routed experts (w1 / w2 / w3 under
    block_sparse_moe) are int4 g32; attention, KDA, shared experts and the dense first
    layer stay float by `ignore` regexes. Float activations: equal to kvloom on the
    dequantized weights to float32 rounding."""
    import re

    from kvloom.cluster.demo_model import write_demo_model

    src = write_demo_model(tmp_path / "kimi", arch="kimi_linear")
    experts = re.compile(r"\.experts\.\d+\.w[123]\.weight$")

    def kimi_ignores(cfg):
        dense = "re:.*block_sparse_moe\\.(gate|up|down)_proj$"  # the dense first layer
        cfg["ignore"] = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", dense]
        return cfg

    quantized = write_quantized(
        src, tmp_path / "q", "w4a16_g32", config_edit=kimi_ignores, pattern=experts
    )
    dequantized = write_dequantized(src, tmp_path / "d", "w4a16_g32", pattern=experts)
    model = llm(quantized).engine.executor.worker.runner.model
    moe_layer = next(layer for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    assert moe_layer.mlp.experts.gate_up.weight_packed.dtype == torch.int32
    ours = kvloom_prompt_logits(llm(quantized), PROMPT)
    ref = kvloom_prompt_logits(llm(dequantized), PROMPT)
    err = (ours - ref).abs().max().item()
    print(f"ERRNORM kimi-linear int4 experts: {err:.3g}")
    assert err <= 1e-5


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda t: t.pop(f"{GPTQ_DOWN}.weight_zero_point"),
            rf"missing 1 weight\(s\): {GPTQ_DOWN}\.weight_offset .*weight_zero_point",
        ),
        (
            lambda t: t.update(
                {f"{GPTQ_DOWN}.weight_zero_point": torch.zeros(3, 1, dtype=torch.int32)}
            ),
            rf"{GPTQ_DOWN}\.weight_zero_point: expected int32",
        ),
    ],
)
def test_bad_compressed_tensors_zero_points_name_the_tensor(dense_src, tmp_path, edit, match):
    quantized = write_quantized(dense_src, tmp_path / "q", "w4a16_asym_g32")
    edit_tensors(quantized, edit)
    with pytest.raises(ValueError, match=match):
        llm(quantized)
