"""Quantized checkpoint weights (FP8, W4A16): config parsing, per-scheme methods, and the
pass that applies them to a model. docs/quantization.md is the user's view."""

from kvloom.workers.layers.quantization.apply import checkpoint_module_names, quantize_model
from kvloom.workers.layers.quantization.config import (
    Fp8Scheme,
    QuantizationConfig,
    W4A16Scheme,
    parse_quantization_config,
)
from kvloom.workers.layers.quantization.scope import deferred_weights

__all__ = [
    "Fp8Scheme",
    "QuantizationConfig",
    "W4A16Scheme",
    "checkpoint_module_names",
    "deferred_weights",
    "parse_quantization_config",
    "quantize_model",
]
