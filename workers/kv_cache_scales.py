"""Per-tensor KV-cache scales read from a checkpoint, for `kv_cache_dtype="fp8"`.

FP8 checkpoints may ship, per attention layer, the scales their keys and values were
calibrated with; an FP8 cache stores k / k_scale and v / v_scale. The names follow what
vLLM reads (its `maybe_remap_kv_scale_name` and compressed-tensors' cache scales):

- `...layers.N.self_attn.k_scale` / `.v_scale` (also `...self_attn.attn.k_scale`),
- `...layers.N.self_attn.k_proj.k_scale` / `.v_proj.v_scale` (ModelOpt),
- `...layers.N.self_attn.kv_scale` (deprecated: one scale for keys and values),
- `...layers.N.self_attn.k_proj.output_scale` / `.v_proj.output_scale` when the
  checkpoint's `quantization_config` has a compressed-tensors `kv_cache_scheme`.

These tensors are taken out of the weight stream before the model loads it (they are no
module's parameter). With an FP8 cache each attention layer gets its scales, 1.0 where the
checkpoint has none (logged, as vLLM warns); with `kv_cache_dtype="auto"` they are unused.
An MLA layer caches one row that is key and value at once and takes k_scale.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Iterator

import torch

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# suffix -> which scale(s) it sets; the longest matching suffix wins.
_SUFFIXES = {
    ".k_proj.k_scale": ("k",),
    ".v_proj.v_scale": ("v",),
    ".k_scale": ("k",),
    ".v_scale": ("v",),
    ".kv_scale": ("k", "v"),
}
_COMPRESSED_TENSORS_SUFFIXES = {
    ".k_proj.output_scale": ("k",),
    ".v_proj.output_scale": ("v",),
}


def has_kv_cache_scheme(hf_config: dict) -> bool:
    """Whether a compressed-tensors checkpoint quantized its KV cache (output scales of
    k_proj / v_proj are then the cache scales)."""
    quant = hf_config.get("quantization_config") or {}
    return bool(quant.get("kv_cache_scheme"))


class KVCacheScales:
    """Collects the checkpoint's KV-cache scales (`take`), then sets them on the layers
    (`apply`)."""

    def __init__(self, compressed_tensors_kv: bool = False, ignored_prefixes: tuple = ()):
        # Tensors under the model's ignored prefixes (MTP heads, vision towers) pass
        # through untouched: the weight loader skips them.
        self.ignored_prefixes = tuple(ignored_prefixes)
        self.suffixes = dict(_SUFFIXES)
        if compressed_tensors_kv:
            self.suffixes.update(_COMPRESSED_TENSORS_SUFFIXES)
        self.found: dict[int, dict[str, float]] = {}
        self.names: dict[int, str] = {}  # layer -> one tensor name, for error messages

    def _which(self, name: str) -> tuple[str, ...] | None:
        matches = [s for s in self.suffixes if name.endswith(s)]
        return self.suffixes[max(matches, key=len)] if matches else None

    def take(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator:
        """The checkpoint's tensors without its KV-cache scales, which are kept here."""
        for name, tensor in weights:
            which = None if name.startswith(self.ignored_prefixes) else self._which(name)
            if which is None:
                yield name, tensor
                continue
            layer = _LAYER.search(name)
            if layer is None:
                raise ValueError(f"KV-cache scale {name!r}: no layer index (layers.N.) in its name")
            if tensor.numel() != 1:
                raise ValueError(
                    f"KV-cache scale {name!r}: expected one per-tensor value, got shape "
                    f"{list(tensor.shape)} (per-head / per-channel KV scales are not supported)"
                )
            value = float(tensor.float().item())
            if not (value > 0.0 and math.isfinite(value)):
                raise ValueError(
                    f"KV-cache scale {name!r}: expected a positive finite value, got {value}"
                )
            index = int(layer.group(1))
            for w in which:
                self.found.setdefault(index, {})[w] = value
            self.names.setdefault(index, name)

    def apply(self, layers: Iterable, kv_cache_dtype: str) -> None:
        """Sets k_scale / v_scale on every attention layer (those that have the attributes)
        for an FP8 cache; for "auto" the checkpoint's scales are left unused."""
        attention = {layer.layer_index: layer for layer in layers if hasattr(layer, "k_scale")}
        stray = sorted(set(self.found) - set(attention))
        if stray:
            raise ValueError(
                f"KV-cache scale {self.names[stray[0]]!r}: layer {stray[0]} has no attention cache"
            )
        if kv_cache_dtype == "auto":
            if self.found:
                logger.info(
                    "the checkpoint has KV-cache scales for %d layer(s); unused with "
                    "kv_cache_dtype='auto'",
                    len(self.found),
                )
            return
        unscaled = []
        for index, layer in attention.items():
            scales = self.found.get(index, {})
            layer.k_scale = scales.get("k", 1.0)
            layer.v_scale = scales.get("v", 1.0)
            if "k" not in scales or "v" not in scales:
                unscaled.append(index)
        if unscaled:
            logger.warning(
                "kv_cache_dtype=%r: the checkpoint has no k/v scale for %d attention layer(s) "
                "(first: %d); using 1.0 there. Values beyond +-448 saturate: use a "
                "checkpoint with calibrated KV-cache scales if accuracy drops",
                kv_cache_dtype,
                len(unscaled),
                min(unscaled),
            )
