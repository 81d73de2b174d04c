"""Qwen3-Next's sparse MoE reads x with one GEMM for its router and shared expert gate
(issue 23): `mlp.gate` [E, H] and `mlp.shared_expert_gate` [1, H], as released, load as the
two shards of one replicated linear [E + 1, H], the router's rows then the shared gate's row.

The fused linear is whole at TP = 1 and on each of two ranks; so are the Qwen3.5-MoE
multimodal checkpoint's (`model.language_model.` names) and the MTP layer's. A W4A16
checkpoint that quantizes both gates fuses them quantized; one that quantizes only one of them
keeps two modules (one GEMM has one scheme). Every case gives transformers' logits on the
(dequantized) weights. The float models against transformers in full, and at TP = 2 over
gloo: tests/test_oracle_qwen3_next.py, tests/test_oracle_qwen3_5_layouts.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from kvloom import LLM
from kvloom.contracts.config import ModelConfig
from kvloom.workers.layers.linear import ColumnParallelLinear
from kvloom.workers.layers.quantization.build import build_model
from kvloom.workers.layers.tp_group import LocalGroup
from kvloom.workers.models.qwen3_5 import Qwen3_5MoeForCausalLM
from kvloom.workers.models.qwen3_next import (
    STACKED_PARAMS,
    Qwen3NextDecoderLayer,
    Qwen3NextForCausalLM,
    Qwen3NextSparseMoe,
)
from kvloom.workers.spec_decode.mtp import (
    MtpHead,
    MtpWeights,
    iterate_mtp_tensors,
    write_mtp_checkpoint,
)
from kvloom.workers.weight_loader import iterate_checkpoint, load_weights
from tests.oracle_helpers import kvloom_prompt_logits
from tests.quant_checkpoints import write_dequantized, write_quantized
from tests.test_oracle_qwen3_next import LOGIT_TOL, TINY_QWEN3_NEXT, save_tiny

EXPERTS = TINY_QWEN3_NEXT["num_experts"]
GATES = ("gate", "shared_expert_gate")
PROMPT = [5, 17, 42, 99, 3, 250, 77, 12, 300, 8, 64, 128]


class RankOf:
    """Rank `rank` of `world` for loading only: it picks shards and runs no collective."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world_size = rank, world

    def all_reduce(self, tensor, dim=-1):
        raise AssertionError("no collective while loading")

    all_gather = all_reduce


def load(klass, path: Path, tp=None):
    """The model as a worker builds it (quantized by its config), checkpoint loaded."""
    model = build_model(klass, ModelConfig(str(path)), torch.float32, tp or LocalGroup(), "cpu")
    load_weights(
        model,
        iterate_checkpoint(path, progress=False),
        model.stacked_params,
        model.ignored_weight_prefixes,
        model.tied,
    )
    return model


def ranks():
    """TP = 1, then each rank of two."""
    yield None
    yield from (RankOf(rank, 2) for rank in range(2))


def moe_layers(model) -> dict[int, Qwen3NextSparseMoe]:
    layers = enumerate(model.model.layers)
    return {i: layer.mlp for i, layer in layers if isinstance(layer.mlp, Qwen3NextSparseMoe)}


def gate_modules(mlp: Qwen3NextSparseMoe) -> set[str]:
    return set(dict(mlp.named_children())) - {"experts", "shared_expert"}


def stacked(tensors: dict, mlp: str, suffix: str) -> torch.Tensor:
    """The fused gate's rows: the router's, then the shared expert gate's."""
    return torch.cat([tensors[f"{mlp}.{gate}.{suffix}"] for gate in GATES])


def assert_fused(mlp: Qwen3NextSparseMoe, tensors: dict, name: str, suffixes=("weight",)):
    """One gate module, [E + 1, H], holding the checkpoint's `suffixes` tensors stacked."""
    assert gate_modules(mlp) == {"gate"}
    assert isinstance(mlp.gate, ColumnParallelLinear)
    assert mlp.gate.output_sizes == [tensors[f"{name}.gate.{suffixes[0]}"].shape[0], 1]
    assert mlp.shared_expert_gate is mlp.gate
    for suffix in suffixes:
        got = getattr(mlp.gate, suffix)
        want = stacked(tensors, name, suffix).to(got.dtype)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.fixture(scope="module")
def src(tmp_path_factory, demo_tokenizer_dir) -> Path:
    return save_tiny(
        tmp_path_factory.mktemp("qwen3-next-gates"), demo_tokenizer_dir, TINY_QWEN3_NEXT
    )


def test_fused_gate_holds_the_released_gates(src):
    tensors = load_file(str(src / "model.safetensors"))
    assert tensors["model.layers.0.mlp.gate.weight"].shape == (EXPERTS, 64)  # names as released
    assert tensors["model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, 64)
    for tp in ranks():
        layers = moe_layers(load(Qwen3NextForCausalLM, src, tp))
        assert sorted(layers) == [0, 1, 3]  # layer 2 is dense (mlp_only_layers)
        for index, mlp in layers.items():
            assert_fused(mlp, tensors, f"model.layers.{index}.mlp")


def test_qwen3_5_moe_multimodal_checkpoint_fuses_too(tmp_path, demo_tokenizer_dir):
    """Text weights under `model.language_model.`, the vision tower beside them."""
    from tests.test_oracle_qwen3_5_layouts import MOE, build

    build("moe", tmp_path, demo_tokenizer_dir)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for tp in ranks():
        model = load(Qwen3_5MoeForCausalLM, tmp_path, tp)
        layers = moe_layers(model)
        assert len(layers) == len(model.model.layers)  # every Qwen3.5-MoE layer is sparse
        for index, mlp in layers.items():
            assert mlp.gate.output_sizes == [MOE["num_experts"], 1]
            assert_fused(mlp, tensors, f"model.language_model.layers.{index}.mlp")


def test_mtp_layer_fuses_its_gates(src, tmp_path):
    """The `mtp` drafter builds the target's decoder layer and loads `mtp.*` by the
    model's STACKED_PARAMS."""
    write_mtp_checkpoint(src, tmp_path, seed=5)
    tensors = load_file(str(tmp_path / "mtp.safetensors"))
    head = MtpHead(TINY_QWEN3_NEXT, Qwen3NextDecoderLayer, 1, LocalGroup(), torch.float32)
    load_weights(
        MtpWeights(head), iterate_mtp_tensors([tmp_path / "mtp.safetensors"]), STACKED_PARAMS
    )
    assert_fused(head.layers[0].mlp, tensors, "mtp.layers.0.mlp")


def int4_checkpoint(src: Path, out: Path, quantized: tuple[str, ...]) -> tuple[Path, Path]:
    """W4A16 g32 on the `quantized` gates of every MoE layer, the other gate left float by
    the config's `ignore`. -> (quantized, dequantized)."""
    pattern = re.compile(rf"\.mlp\.({'|'.join(quantized)})\.weight$")

    def config(cfg):
        cfg["config_groups"]["group_0"]["targets"] = [rf"re:.*\.mlp\.({'|'.join(GATES)})$"]
        cfg["ignore"] = ["lm_head", *(rf"re:.*\.mlp\.{g}$" for g in GATES if g not in quantized)]
        return cfg

    q = write_quantized(src, out / "q", "w4a16_g32", config_edit=config, pattern=pattern)
    return q, write_dequantized(src, out / "d", "w4a16_g32", pattern=pattern)


@pytest.mark.parametrize("quantized", [(), GATES, ("gate",), ("shared_expert_gate",)],
                         ids=["float", "both-int4", "gate-int4", "shared-gate-int4"])  # fmt: skip
def test_gates_fuse_only_where_quantized_alike(src, tmp_path, quantized):
    path, reference = int4_checkpoint(src, tmp_path, quantized) if quantized else (src, src)
    tensors = load_file(str(path / "model.safetensors"))
    packed = ("weight_packed", "weight_scale")
    for tp in ranks():  # the gates are whole on every rank, fused or not
        for index, mlp in moe_layers(load(Qwen3NextForCausalLM, path, tp)).items():
            name = f"model.layers.{index}.mlp"
            if len(quantized) != 1:
                assert_fused(mlp, tensors, name, packed if quantized else ("weight",))
                assert (mlp.gate.quant_method is None) == (not quantized)
                continue
            assert gate_modules(mlp) == set(GATES)  # two schemes: two GEMMs
            for gate in GATES:
                module = getattr(mlp, gate)
                assert (module.quant_method is not None) == (gate in quantized)
                for suffix in packed if gate in quantized else ("weight",):
                    want = tensors[f"{name}.{gate}.{suffix}"]
                    got = getattr(module, suffix)
                    torch.testing.assert_close(got, want.to(got.dtype), rtol=0, atol=0)

    hf = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    ours = kvloom_prompt_logits(
        LLM(str(path), dtype="float32", progress=False, block_size=16), PROMPT
    )
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    assert ref.abs().max() > 1.0
    err = (ours - ref).abs().max().item()
    print(f"ERRNORM gates quantized {quantized}: max |logit diff| {err:.3g}")
    assert err <= LOGIT_TOL, f"gates quantized {quantized}: max |logit diff| {err:.3g}"


def test_multimodal_checkpoint_quantizing_one_gate_keeps_two(tmp_path, demo_tokenizer_dir):
    """A Qwen3.5-MoE multimodal checkpoint carries its quantization_config at the top
    level, beside text_config: the text model must see it to keep the gates apart."""
    from tests.test_oracle_qwen3_5_layouts import build

    build("moe", tmp_path / "src", demo_tokenizer_dir)

    def config(cfg):
        cfg["config_groups"]["group_0"]["targets"] = [rf"re:.*\.mlp\.({'|'.join(GATES)})$"]
        cfg["ignore"] = ["lm_head", r"re:.*\.mlp\.shared_expert_gate$"]
        return cfg

    pattern = re.compile(r"\.mlp\.gate\.weight$")
    path = write_quantized(
        tmp_path / "src", tmp_path / "q", "fp8_channel", config_edit=config, pattern=pattern
    )
    assert (
        "quantization_config" not in json.loads((path / "config.json").read_text())["text_config"]
    )
    for mlp in moe_layers(load(Qwen3_5MoeForCausalLM, path)).values():
        assert gate_modules(mlp) == set(GATES)
        assert mlp.gate.quant_method is not None and mlp.shared_expert_gate.quant_method is None
