"""`quantization_config` parsing and per-module scheme matching (no model needed)."""

from __future__ import annotations

import pytest
import torch

from kvloom.workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from kvloom.workers.layers.quantization import (
    Fp8Scheme,
    W4A16Scheme,
    deferred_weights,
    parse_quantization_config,
    quantize_model,
)
from tests.quant_checkpoints import quantization_config

KIMI_INT4 = {  # shaped like the INT4 releases of Kimi models (targets "Linear", "re:" ignores)
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": 32, "dynamic": False, "actorder": None,
                        "observer": "minmax", "observer_kwargs": {}},  # fmt: skip
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
}  # fmt: skip


def test_fp8_block_config():
    cfg = parse_quantization_config(quantization_config("fp8_block"))
    scheme = Fp8Scheme((128, 128), "weight_scale_inv")
    assert cfg.scheme_for(["model.layers.0.self_attn.q_proj"], "q") == scheme
    # modules_to_not_convert entries match whole dotted parts of a module's path.
    assert cfg.scheme_for(["model.layers.3.mlp.gate"], "router") is None
    assert cfg.scheme_for(["model.layers.3.mlp.gate_proj"], "gate_proj") == scheme
    assert cfg.scheme_for(["lm_head"], "lm_head") is None


def test_kimi_int4_targets_and_ignores():
    cfg = parse_quantization_config(KIMI_INT4)
    experts = [f"model.layers.1.mlp.experts.{e}.{p}" for e in range(3) for p in ("w1", "w3")]
    assert cfg.scheme_for(experts, "experts") == W4A16Scheme(32)
    assert cfg.scheme_for(["model.layers.1.self_attn.q_proj"], "q") is None
    assert cfg.scheme_for(["model.layers.0.mlp.down_proj"], "dense mlp") is None
    assert cfg.scheme_for(["model.layers.1.mlp.shared_experts.down_proj"], "shared") is None


@pytest.mark.parametrize(
    ("scheme", "want", "stored_zero"),
    [
        ("gptq_g128", W4A16Scheme(128), 7),
        ("gptq_v2_g32", W4A16Scheme(32), 8),
        ("gptq_asym_g32", W4A16Scheme(32, zero_point=True), 7),
        ("gptq_v2_asym_g32", W4A16Scheme(32, zero_point=True), 8),
        ("awq_g32", W4A16Scheme(32, zero_point=True), None),
    ],
)
def test_int4_configs_take_their_modules_from_the_checkpoint(scheme, want, stored_zero):
    """GPTQ and AWQ configs name no modules: those with a qweight are quantized."""
    from kvloom.workers.layers.quantization.int4_layouts import int4_keys, qweight_modules

    cfg = parse_quantization_config(quantization_config(scheme))
    assert cfg.gptq_stored_zero == stored_zero
    keys = ["m.q_proj.qweight", "m.q_proj.scales", "m.q_proj.qzeros"]
    keys += ["m.q_proj.g_idx"] if cfg.method == "gptq" else []  # checked and dropped
    keys += ["m.gate.weight", "lm_head.weight"]
    cfg.bind_checkpoint(qweight_modules(keys))
    assert cfg.scheme_for(["m.q_proj"], "q") == want
    assert cfg.scheme_for(["m.gate"], "router") is None
    assert cfg.scheme_for(["lm_head"], "lm_head") is None
    zeros = "m.q_proj.weight_offset" if want.zero_point else None
    renamed = ["m.q_proj.weight_packed", "m.q_proj.weight_shape", "m.q_proj.weight_scale"]
    renamed += [zeros] if zeros else []
    want_keys = [*renamed, "m.gate.weight", "lm_head.weight"]
    assert int4_keys(keys, cfg.method, want.zero_point) == want_keys


def test_compressed_tensors_fp8_schemes():
    channel = parse_quantization_config(quantization_config("fp8_channel"))
    tensor = parse_quantization_config(quantization_config("fp8_tensor"))
    assert channel.scheme_for(["a.q_proj"], "q") == Fp8Scheme(None, "weight_scale")
    assert tensor.scheme_for(["a.q_proj"], "q") == Fp8Scheme(None, "weight_scale", per_tensor=True)
    static = quantization_config("fp8_tensor")
    static["config_groups"]["group_0"]["input_activations"].update(dynamic=False, strategy="tensor")
    scheme = parse_quantization_config(static).scheme_for(["a.q_proj"], "q")
    assert scheme.static_input and scheme.per_tensor


def test_no_config_is_a_float_model():
    assert parse_quantization_config(None) is None


def test_parts_that_disagree_are_refused():
    cfg = parse_quantization_config(KIMI_INT4)
    with pytest.raises(ValueError, match="parts of x are quantized differently"):
        cfg.scheme_for(["m.experts.0.w1", "m.self_attn.q_proj"], "x")


class HalfRankGroup:
    """Rank 0 of two, for layer geometry only (no collective is called)."""

    rank, world_size = 0, 2


@pytest.mark.parametrize("layer", ["row", "column"])
def test_a_tensor_parallel_shard_that_splits_a_block_is_refused(layer):
    """Row-parallel ranks need whole 128-column blocks; column-parallel rows do not."""
    with deferred_weights():
        if layer == "row":
            module = RowParallelLinear(128, 64, tp=HalfRankGroup())
        else:
            module = ColumnParallelLinear(128, [64], tp=HalfRankGroup())
    cfg = parse_quantization_config(quantization_config("fp8_block"))
    names = {"": ["model.layers.0.self_attn.o_proj"]}
    if layer == "row":
        with pytest.raises(ValueError, match=r"per rank 64\) must be a multiple of weight_block"):
            quantize_model(module, cfg, names, torch.device("cpu"))
    else:
        quantize_model(module, cfg, names, torch.device("cpu"))
        assert module.weight.shape == (32, 128) and module.weight_scale_inv.shape == (32, 1)


def test_deferred_layers_hold_no_float_weight_until_quantized():
    with deferred_weights():
        module = ColumnParallelLinear(64, [32])
    assert module.weight.is_meta
    cfg = parse_quantization_config(quantization_config("w4a16_g32"))
    quantize_model(module, cfg, {"": ["x.q_proj"]}, torch.device("cpu"))
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    assert shapes == {"weight_packed": (32, 8), "weight_scale": (32, 2), "weight_shape": (1, 2)}
