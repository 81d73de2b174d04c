"""compressed-tensors' asymmetric int4 (`pack-quantized`, `symmetric: false`), read as W4A16
with zero-point offsets.

Such a layer stores, beside `weight_packed` and `weight_scale` [N, K / g], a
`weight_zero_point` int32 [ceil(N / 8), K / g]: the signed zero point zp in [-8, 7] of each
output row and group, stored + 8 and packed eight to a word along N (compressed-tensors'
`pack_to_int32(..., packed_dim=0)`: row n at bits 4 * (n % 8) of word n // 8, lowest nibble
first). The weight is w = (q - zp) * s with q the signed value `weight_packed` holds.

The W4A16 kernels compute q * s, so a zero point becomes what AWQ's become
(int4_layouts.py): `weight_offset` [N, K / g] = s * zp in float32, which the zero-point
W4A16 method subtracts per group. `ZeroPointReader` makes it from the two tensors as they
arrive; `zero_point_keys` renames the checkpoint's keys the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kvloom.kernels.w4a16_gemm import INT4_OFFSET

ZERO_POINT, SCALE, OFFSET = "weight_zero_point", "weight_scale", "weight_offset"


def _split(name: str) -> tuple[str, str]:
    module, _, suffix = name.rpartition(".")
    return module, suffix


def zero_point_modules(keys: Iterable[str]) -> set[str]:
    """The checkpoint modules with a `weight_zero_point`."""
    return {module for module, suffix in map(_split, keys) if suffix == ZERO_POINT}


def zero_point_keys(keys: Iterable[str]) -> list[str]:
    """The checkpoint's tensor names as `ZeroPointReader` yields them."""
    return [f"{_split(key)[0]}.{OFFSET}" if _split(key)[1] == ZERO_POINT else key for key in keys]


def unpack_rows(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """[ceil(rows / 8), C] int32 packed along dim 0 -> [rows, C] int64 stored nibbles."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    nibbles = (packed.to(torch.int64).unsqueeze(1) >> shifts[None, :, None]) & 0xF
    return nibbles.flatten(0, 1)[:rows]


class ZeroPointReader:
    """Turns each zero-point module's `weight_scale` and `weight_zero_point` into
    `weight_scale` and `weight_offset` as both arrive; other tensors pass unchanged."""

    def __init__(self, modules: set[str]):
        self.modules = modules
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator:
        for name, tensor in weights:
            module, suffix = _split(name)
            if module not in self.modules or suffix not in (SCALE, ZERO_POINT):
                yield name, tensor
                continue
            parts = self.pending.setdefault(module, {})
            parts[suffix] = tensor
            if len(parts) == 2:
                yield from self._convert(module, self.pending.pop(module))
        for module, parts in self.pending.items():
            missing = SCALE if SCALE not in parts else ZERO_POINT
            raise ValueError(f"{module}.{missing}: missing from the checkpoint")

    def _convert(self, module: str, parts: dict[str, torch.Tensor]) -> Iterator:
        scale, packed = parts[SCALE], parts[ZERO_POINT]
        n, groups = scale.shape if scale.dim() == 2 else (None, None)
        want = (-(-n // 8), groups) if n is not None else None
        if packed.dtype != torch.int32 or tuple(packed.shape) != want:
            raise ValueError(
                f"{module}.{ZERO_POINT}: expected int32 {list(want or [])} (eight rows a word, "
                f"beside {SCALE} {list(scale.shape)}), got {packed.dtype} {list(packed.shape)}"
            )
        zero = unpack_rows(packed, n) - INT4_OFFSET  # signed, [N, K / g]
        yield f"{module}.{SCALE}", scale
        yield f"{module}.{OFFSET}", zero.to(torch.float32) * scale.to(torch.float32)
