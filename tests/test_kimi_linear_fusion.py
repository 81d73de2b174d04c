"""Kimi-Linear's KDA projections fused by input (issue 23): b_proj into qkv_proj (q | k | v |
beta's logits, each split by head over ranks) and f_a / g_a into one replicated fg_a_proj,
7 -> 5 GEMMs per layer, loaded from checkpoints that keep the original tensor names.

The layer holds exactly the fused linears, whose weights are the checkpoint's tensors stacked:
whole at TP = 1, and on each of two ranks each part's rows of that rank's heads (fg_a_proj
whole on both). An int4 (W4A16) checkpoint that quantizes every part fuses them quantized;
one whose `ignore` leaves b_proj and g_a_proj float keeps those two as their own modules
(one GEMM has one scheme); both give transformers' logits on the dequantized weights. q/k/v
quantized differently is refused, naming the tensors. The float model against transformers,
and at TP = 2 over gloo: tests/test_oracle_kimi_linear.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from kvloom import LLM
from kvloom.contracts.config import ModelConfig
from kvloom.workers.layers.kda_layer import KimiDeltaAttention
from kvloom.workers.layers.quantization.build import build_model
from kvloom.workers.layers.tp_group import LocalGroup
from kvloom.workers.models.kimi_linear import KimiLinearForCausalLM
from kvloom.workers.weight_loader import iterate_checkpoint, load_weights
from tests.quant_checkpoints import write_dequantized, write_quantized
from tests.test_oracle_kimi_linear import assert_logits_match, build_kimi

HEADS, DH = 2, 16  # KIMI_TINY's KDA shape (linear_num_heads, linear_head_dim)
FUSED = {"qkv_proj", "fg_a_proj", "f_b_proj", "g_b_proj", "o_proj"}
QUANTIZABLE = ("q", "k", "v", "b", "f_a", "g_a")  # the fused parts


class RankOf:
    """Rank `rank` of `world` for loading only: it picks shards and runs no collective."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world_size = rank, world

    def all_reduce(self, tensor, dim=-1):
        raise AssertionError("no collective while loading")

    all_gather = all_reduce


def load(path: Path, tp=None, tensors: dict | None = None) -> KimiLinearForCausalLM:
    """The model as a worker builds it (quantized by its config) with the checkpoint loaded
    (or `tensors` in its place)."""
    model = build_model(
        KimiLinearForCausalLM, ModelConfig(str(path)), torch.float32, tp or LocalGroup(), "cpu"
    )
    load_weights(
        model,
        iterate_checkpoint(path, progress=False) if tensors is None else iter(tensors.items()),
        model.stacked_params,
        model.ignored_weight_prefixes,
        model.tied,
    )
    return model


def kda_layers(model) -> dict[int, KimiDeltaAttention]:
    layers = [layer.self_attn for layer in model.model.layers]
    return {a.layer_index: a for a in layers if isinstance(a, KimiDeltaAttention)}


def linears(attn: KimiDeltaAttention) -> set[str]:
    return {name for name, m in attn.named_children() if hasattr(m, "quant_geometry")}


def rank_rows(tensors: dict, prefix: str, parts, suffix: str, rank: int, world: int):
    """The fused rows a rank holds: each part's slice of its heads, stacked in order."""
    rows = []
    for part in parts:
        full = tensors[f"{prefix}.{part}_proj.{suffix}"]
        size = full.shape[0] // world
        rows.append(full[rank * size : (rank + 1) * size])
    return torch.cat(rows)


@pytest.fixture(scope="module")
def src(tmp_path_factory, demo_tokenizer_dir) -> Path:
    return build_kimi(tmp_path_factory.mktemp("kimi-fusion"), demo_tokenizer_dir)


@pytest.mark.parametrize("world", [1, 2], ids=["tp1", "tp2"])
def test_fused_modules_hold_the_checkpoint_tensors(src, world):
    tensors = load_file(str(src / "model.safetensors"))
    assert "model.layers.0.self_attn.b_proj.weight" in tensors  # names as released
    for rank in range(world):
        model = load(src, RankOf(rank, world) if world > 1 else None)
        for index, attn in kda_layers(model).items():
            assert linears(attn) == FUSED
            assert attn.qkv_proj.output_sizes == [HEADS * DH] * 3 + [HEADS]
            assert attn.fg_a_proj.output_sizes == [DH, DH]
            prefix = f"model.layers.{index}.self_attn"
            qkvb = rank_rows(tensors, prefix, "qkvb", "weight", rank, world)
            torch.testing.assert_close(attn.qkv_proj.weight, qkvb, rtol=0, atol=0)
            fg_a = rank_rows(tensors, prefix, ("f_a", "g_a"), "weight", 0, 1)  # replicated
            torch.testing.assert_close(attn.fg_a_proj.weight, fg_a, rtol=0, atol=0)


def test_transformers_forget_gate_names_load_too(src):
    """transformers' module names nest f_a / f_b / A_log / dt_bias in self_attn.forget_gate."""
    tensors = load_file(str(src / "model.safetensors"))
    nested = r"self_attn.forget_gate.\1"
    renamed = {
        re.sub(r"self_attn\.(f_[ab]_proj|A_log|dt_bias)", nested, k): v for k, v in tensors.items()
    }
    assert "model.layers.0.self_attn.forget_gate.f_a_proj.weight" in renamed
    for index, attn in kda_layers(load(src, tensors=renamed)).items():
        fg_a = rank_rows(tensors, f"model.layers.{index}.self_attn", ("f_a", "g_a"), "weight", 0, 1)
        torch.testing.assert_close(attn.fg_a_proj.weight, fg_a, rtol=0, atol=0)


def int4_checkpoint(src: Path, out: Path, ignored=()):
    """W4A16 g32 on every fused part of the KDA layers (0, 2, 3) except the `ignored`
    parts, which the config's `ignore` list leaves float. -> (quantized, dequantized)."""
    kept = "|".join(p for p in QUANTIZABLE if p not in ignored)
    pattern = re.compile(rf"layers\.[023]\.self_attn\.({kept})_proj\.weight$")

    def config(cfg):
        parts = "|".join(QUANTIZABLE)
        cfg["config_groups"]["group_0"]["targets"] = [
            rf"re:.*layers\.[023]\.self_attn\.({parts})_proj$"
        ]
        cfg["ignore"] = ["lm_head", *(rf"re:.*self_attn\.{p}_proj$" for p in ignored)]
        return cfg

    quantized = write_quantized(src, out / "q", "w4a16_g32", config_edit=config, pattern=pattern)
    return quantized, write_dequantized(src, out / "d", "w4a16_g32", pattern=pattern)


@pytest.mark.parametrize(
    "ignored,expected",
    [((), FUSED), (("b", "g_a"), FUSED - {"fg_a_proj"} | {"b_proj", "f_a_proj", "g_a_proj"})],
    ids=["all-int4", "b-g_a-float"],
)
def test_int4_parts_fuse_only_where_quantized_alike(src, tmp_path, ignored, expected):
    quantized, dequantized = int4_checkpoint(src, tmp_path, ignored)
    tensors = load_file(str(quantized / "model.safetensors"))
    fused_b = "b" not in ignored
    for rank in range(2):
        model = load(quantized, RankOf(rank, 2))
        for index, attn in kda_layers(model).items():
            assert linears(attn) == expected
            prefix = f"model.layers.{index}.self_attn"
            parts = "qkvb" if fused_b else "qkv"
            for suffix in ("weight_packed", "weight_scale"):
                got = getattr(attn.qkv_proj, suffix)  # scales in the model's dtype
                want = rank_rows(tensors, prefix, parts, suffix, rank, 2).to(got.dtype)
                torch.testing.assert_close(got, want, rtol=0, atol=0)
            if fused_b:  # f_a | g_a quantized too, whole on each rank
                packed = rank_rows(tensors, prefix, ("f_a", "g_a"), "weight_packed", 0, 1)
                torch.testing.assert_close(attn.fg_a_proj.weight_packed, packed, rtol=0, atol=0)
            else:  # b_proj float, column-parallel by head on its own; f_a int4, g_a float
                b = rank_rows(tensors, prefix, "b", "weight", rank, 2)
                torch.testing.assert_close(attn.b_proj.weight, b, rtol=0, atol=0)
                assert attn.f_a_proj.quant_method is not None
                assert attn.g_a_proj.quant_method is None

    hf = transformers.AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32)
    llm = LLM(str(quantized), dtype="float32", progress=False, block_size=16)
    assert_logits_match(llm, hf.eval(), f"kimi_linear int4 ignoring {ignored}")


def test_q_k_v_quantized_differently_are_refused_by_name(src, tmp_path):
    quantized, _ = int4_checkpoint(src, tmp_path, ignored=("k",))
    with pytest.raises(ValueError, match=r"parts of model\.layers\.0\.self_attn\.qkv_proj.*k_proj"):
        load(quantized)
