"""Builds a model for its checkpoint: float as before, or quantized as the checkpoint's
`quantization_config` says (weights deferred while the model is built, then created by
the quantization pass, so a quantized model never holds its float weights)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from kvloom.kernels.dispatch import set_batch_invariant
from kvloom.workers.layers.quantization.apply import checkpoint_module_names, quantize_model
from kvloom.workers.layers.quantization.config import parse_quantization_config
from kvloom.workers.layers.quantization.ct_zero_points import (
    ZeroPointReader,
    zero_point_keys,
    zero_point_modules,
)
from kvloom.workers.layers.quantization.int4_layouts import Int4Reader, int4_keys, qweight_modules
from kvloom.workers.layers.quantization.scope import deferred_weights
from kvloom.workers.weight_loader import checkpoint_keys

INT4_LAYOUTS = ("gptq", "awq")  # methods whose tensors int4_layouts.py translates


def build_model(klass, model_config, dtype: torch.dtype, tp, device) -> nn.Module:
    """`klass(text_config, dtype, tp)` on `device`; `model_config` is a ModelConfig.
    Sets this process's kernel plans to the config's deterministic mode first."""
    set_batch_invariant(model_config.deterministic)
    if model_config.deterministic:
        from kvloom.kernels.batch_invariant_triton import load_env_matmul_table

        load_env_matmul_table()
    qconfig = parse_quantization_config(model_config.quantization)
    with torch.device(device), deferred_weights(qconfig is not None):
        model = klass(model_config.text_config, dtype, tp)
    if qconfig is None:
        return model
    if model_config.load_format == "dummy":
        # No checkpoint to name the modules (benchmarks of real shapes): each layer goes by
        # its own path, which the rules' class targets and `lm_head` exclusions match.
        names = {
            path: [path]
            for path, module in model.named_modules()
            if hasattr(module, "quant_geometry")
        }
        quantize_model(model, qconfig, names, device)
        return model
    keys = checkpoint_keys(Path(model_config.model))
    if qconfig.method in INT4_LAYOUTS:
        qconfig.bind_checkpoint(qweight_modules(keys))
        keys = int4_keys(keys, qconfig.method, qconfig.rules[0][1].zero_point)
    keys = zero_point_keys(keys)
    names = checkpoint_module_names(
        model, keys, klass.stacked_params, klass.ignored_weight_prefixes
    )
    quantize_model(model, qconfig, names, device, keys)
    return model


def checkpoint_weights(model_config, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable:
    """The checkpoint's tensors as the model's layers load them: a GPTQ or AWQ
    checkpoint's turned into the W4A16 layout (int4_layouts.py), compressed-tensors' zero
    points into offsets (ct_zero_points.py), any other's unchanged."""
    qconfig = parse_quantization_config(model_config.quantization)
    if qconfig is None:
        return weights
    if qconfig.method not in INT4_LAYOUTS:  # compressed-tensors' asymmetric int4, if any
        modules = zero_point_modules(checkpoint_keys(Path(model_config.model)))
        return ZeroPointReader(modules)(weights) if modules else weights
    scheme = qconfig.rules[0][1]
    return Int4Reader(
        qconfig.method, scheme.group_size, qconfig.gptq_stored_zero, scheme.zero_point
    )(weights)
