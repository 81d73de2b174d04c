"""Turns a model built under `scope.deferred_weights()` into the checkpoint's quantized
model: each quantizable layer (linear layers, stacked expert weights) gets the scheme its
checkpoint modules have under `quantization_config`, and a method that owns its weights;
the rest get their float weight allocated for real."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

import torch
from torch import nn

from kvloom.workers.layers.quantization.config import QuantizationConfig
from kvloom.workers.layers.quantization.methods import make_method
from kvloom.workers.weight_loader import resolve_name

logger = logging.getLogger(__name__)
# Layers that read their weight directly (absorbed MLA reshapes kv_b_proj's weight).
FLOAT_ONLY_SUFFIXES = ("kv_b_proj",)


def checkpoint_module_names(
    model: nn.Module,
    keys: Iterable[str],
    stacked_params: Iterable[tuple[str, str, int]],
    ignored_prefixes: tuple[str, ...] = (),
) -> dict[str, list[str]]:
    """kvloom module path -> the checkpoint modules whose tensors it loads (the names
    quantization rules are written against), by the model's own name mapping."""
    custom = getattr(model, "map_weight_name", None)
    found: dict[str, set[str]] = {}
    for key in keys:
        if key.startswith(ignored_prefixes) or key.endswith("rotary_emb.inv_freq"):
            continue
        entry = (custom(key) if custom else None) or resolve_name(key, stacked_params)
        found.setdefault(entry[0], set()).add(key.rpartition(".")[0])
    return {path: sorted(names) for path, names in found.items()}


def quantize_model(
    model: nn.Module,
    qconfig: QuantizationConfig,
    module_names: dict[str, list[str]],
    device: torch.device,
    keys: Iterable[str] = (),
) -> Counter:
    """Gives every deferred layer its weights; returns how many layers got each scheme.
    `keys` (the checkpoint's tensor names) lets a float tensor in a module the config
    quantizes be reported as such, not as an unexpected name."""
    keys = set(keys)
    counts: Counter = Counter()
    for path, module in model.named_modules():
        if not hasattr(module, "quant_geometry"):
            continue
        names = module_names.get(path, [])
        scheme = qconfig.scheme_for(names, path) if names else None
        if scheme is None:
            if module.weight.is_meta:
                module.weight = nn.Parameter(torch.empty_like(module.weight, device=device), False)
            counts["float"] += 1
            continue
        if path.endswith(FLOAT_ONLY_SUFFIXES):
            raise ValueError(
                f"{path}: quantization_config quantizes it ({scheme.name}), which kvloom does "
                "not support for this layer yet"
            )
        method = make_method(scheme, module.quant_geometry(), module.weight.dtype, path)
        wanted = method.param_shapes()
        for name in names:
            if f"{name}.weight" in keys and "weight" not in wanted:
                raise ValueError(
                    f"{name}.weight: quantization_config quantizes {path} ({scheme.name}), "
                    f"but the checkpoint stores a float weight for it (no {name}."
                    f"{next(iter(wanted))})"
                )
        method.create_weights(module, device)
        module.quant_method = method
        counts[scheme.name] += 1
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"parameters left unallocated after quantization: {', '.join(left[:4])}")
    for module in model.modules():
        _check_moe(module)
    logger.info(
        "quantized layers: %s", ", ".join(f"{n} {name}" for name, n in sorted(counts.items()))
    )
    return counts


def _check_moe(module: nn.Module) -> None:
    up, down = getattr(module, "gate_up", None), getattr(module, "down", None)
    if up is None or down is None or not hasattr(up, "quant_geometry"):
        return
    schemes = [getattr(m.quant_method, "scheme", None) for m in (up, down)]
    if schemes[0] != schemes[1]:
        names = [s.name if s else "float" for s in schemes]
        raise ValueError(
            f"MoE experts: gate/up are {names[0]} but down is {names[1]}; kvloom runs "
            "both projections in one fused kernel, which needs one scheme"
        )
