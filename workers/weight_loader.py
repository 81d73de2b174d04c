"""Reads safetensors checkpoints (single file or sharded with an index) into a model.

Models name how checkpoint tensors map onto their modules: `stacked_params` fuse several
checkpoint tensors into one module (q/k/v into qkv_proj), each module copies its own
tensor-parallel slice (`load_shard`). Missing, unexpected or mis-shaped tensors raise
ValueError naming the tensor.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

logger = logging.getLogger(__name__)


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"missing weight file(s) named in {index.name}: {', '.join(absent)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weight file in {model_dir}")
    return files


def checkpoint_keys(model_dir: Path) -> list[str]:
    """Every tensor name in the checkpoint (headers only, no tensor is read)."""
    keys: list[str] = []
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            keys.extend(f.keys())
    return keys


def iterate_checkpoint(
    model_dir: Path, progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    files = checkpoint_files(model_dir)
    total = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            total += len(f.keys())
    bar = tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress)
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield key, f.get_tensor(key)
                bar.update(1)
    bar.close()


def loadable_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if hasattr(m, "load_shard")}


def expected_entries(modules: dict[str, nn.Module]) -> set[tuple[str, str, int]]:
    """(module path, parameter name, shard index) for every tensor a model needs. A module
    loaded from several checkpoint tensors says how many with `num_shards` (or, for a
    fused column-parallel linear, `output_sizes`)."""
    entries = set()
    for name, module in modules.items():
        shards = getattr(module, "num_shards", None) or len(getattr(module, "output_sizes", [0]))
        for param_name, _ in module.named_parameters(recurse=False):
            for shard in range(shards):
                entries.add((name, param_name, shard))
    return entries


def resolve_name(
    ckpt_name: str, stacked_params: Iterable[tuple[str, str, int]]
) -> tuple[str, str, int]:
    module_path, _, param_name = ckpt_name.rpartition(".")
    for fused, original, index in stacked_params:
        if module_path.endswith("." + original) or module_path == original:
            return module_path[: -len(original)] + fused, param_name, index
    return module_path, param_name, 0


def _unpacked(weights: Iterable[tuple[str, torch.Tensor]], unpack, ignored: tuple) -> Iterator:
    """The checkpoint's tensors with packed ones split by the model's `unpack_weight`
    (ignored ones passed through untouched: their shapes are not the model's business)."""
    for name, tensor in weights:
        parts = unpack(name, tensor) if unpack and not name.startswith(ignored) else None
        yield from parts if parts is not None else ((name, tensor),)


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params: Iterable[tuple[str, str, int]] = (),
    ignored_prefixes: tuple[str, ...] = (),
    tied: dict[str, str] | None = None,
) -> None:
    """stacked_params: (fused module suffix, checkpoint suffix, shard index).
    tied: module -> module whose tensor it reuses when the checkpoint lacks its own.
    A model with its own naming (e.g. per-expert MoE tensors) defines
    `map_weight_name(ckpt_name) -> (module path, param name, shard) | None`; None falls
    back to the rules above. A model whose checkpoints may pack several module tensors in
    one (3-D expert stacks) defines `unpack_weight(ckpt_name, tensor) -> [(name, tensor)] |
    None`. Tensors under `ignored_prefixes` (vision towers, MTP heads) are skipped with one
    log line per prefix."""
    custom = getattr(model, "map_weight_name", None)
    unpack = getattr(model, "unpack_weight", None)
    modules = loadable_modules(model)
    expected = expected_entries(modules)
    tied = tied or {}
    loaded: set[tuple[str, str, int]] = set()
    kept: dict[tuple[str, str, int], torch.Tensor] = {}  # sources of tied modules only
    skipped: Counter[str] = Counter()
    for ckpt_name, tensor in _unpacked(weights, unpack, ignored_prefixes):
        if ckpt_name.startswith(ignored_prefixes):
            skipped[next(p for p in ignored_prefixes if ckpt_name.startswith(p))] += 1
            continue
        if ckpt_name.endswith("rotary_emb.inv_freq"):
            continue
        entry = (custom(ckpt_name) if custom else None) or resolve_name(ckpt_name, stacked_params)
        module = modules.get(entry[0])
        if module is None or entry not in expected:
            raise ValueError(f"unexpected weight {ckpt_name!r} in checkpoint")
        try:
            module.load_shard(entry[1], tensor, entry[2])
        except ValueError as err:
            raise ValueError(f"{ckpt_name}: {err}") from None
        loaded.add(entry)
        if entry[0] in tied.values():
            kept[entry] = tensor
    for target, source in tied.items():
        for entry in [e for e in expected if e[0] == target and e not in loaded]:
            src = (source, entry[1], entry[2])
            if src in kept:
                modules[target].load_shard(entry[1], kept[src], entry[2])
                loaded.add(entry)
    for prefix, count in skipped.items():
        logger.info("skipped %d checkpoint tensor(s) under %r (not used by kvloom)", count, prefix)
    missing = sorted(f"{m}.{p}" + (f"[shard {s}]" if s else "") for m, p, s in expected - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        hint = ""
        if any(name.split("[")[0].endswith(".weight_offset") for name in missing):
            hint = (
                " (a weight_offset is made from a zero-point layer's weight_zero_point in "
                "compressed-tensors with symmetric: false, or its qzeros in GPTQ / AWQ)"
            )
        raise ValueError(f"checkpoint is missing {len(missing)} weight(s): {shown}{hint}")
