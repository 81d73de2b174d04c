"""Checks a drafter checkpoint's tensors against its published layout before loading.

EAGLE-3 and DFlash heads are read from the safetensors headers first (names and shapes,
no data), so a missing, unexpected or misshaped tensor is an error naming the tensor as
the published format spells it, before anything is allocated.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from kvloom.workers.weight_loader import checkpoint_files, iterate_checkpoint


def read_config(head_dir: str, field: str) -> dict:
    path = Path(head_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{field}: {head_dir} has no config.json")
    return json.loads(path.read_text())


def tensor_shapes(head_dir: str) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for path in checkpoint_files(Path(head_dir)):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def check_tensors(
    found: dict[str, tuple[int, ...]],
    expected: dict[str, tuple[int, ...]],
    optional: dict[str, tuple[int, ...]],
    where: str,
) -> None:
    """expected: tensors the format requires; optional: ones it may carry."""
    missing = sorted(set(expected) - set(found))
    if missing:
        shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
        raise ValueError(f"{where}: the checkpoint lacks {len(missing)} tensor(s): {shown}")
    unexpected = sorted(set(found) - set(expected) - set(optional))
    if unexpected:
        shown = ", ".join(unexpected[:6]) + (" ..." if len(unexpected) > 6 else "")
        raise ValueError(f"{where}: unexpected tensor(s) in the checkpoint: {shown}")
    for name, shape in {**expected, **optional}.items():
        if name in found and found[name] != shape:
            raise ValueError(
                f"{where}: tensor {name} has shape {list(found[name])}, expected {list(shape)}"
            )


def load_named(head_dir: str, names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors called `names` (small ones: vocabulary maps), read on their own."""
    out = {}
    for path in checkpoint_files(Path(head_dir)):
        with safe_open(str(path), framework="pt") as f:
            for key in names & set(f.keys()):
                out[key] = f.get_tensor(key)
    return out


def iterate_except(head_dir: str, skipped: set[str], progress: bool, rename=None):
    """The checkpoint's tensors but `skipped`, renamed by `rename(name)` if given."""
    for name, tensor in iterate_checkpoint(Path(head_dir), progress=progress):
        if name not in skipped:
            yield (rename(name) if rename else name), tensor
