"""GPTQ int4 checkpoints (`quant_method: "gptq"`, AutoGPTQ / GPTQModel), read as W4A16.

A symmetric GPTQ layer without activation reordering (`sym: true`, `desc_act: false`) is
the same weight as compressed-tensors' `pack-quantized` layout that the W4A16 kernels run,
stored transposed:

* `qweight` int32 [K / 8, N]: eight consecutive input features per word, feature k at
  bits 4 * (k % 8), lowest nibble first, as unsigned values u in [0, 15];
* `scales` float16 [K / g, N]; `qzeros` int32 [K / g, N / 8] (packed along N), the zero
  point z of each group and output column; `g_idx` int32 [K] (optional) the group of
  each input feature;
* w[n, k] = scales[k // g, n] * (u[k, n] - z). GPTQ's original format ("gptq") stores
  z - 1, its v2 format ("gptq_v2") z itself.

With z = 8 for every group (what `sym: true` writes), u - 8 is compressed-tensors' signed
value and u its stored nibble, so `weight_packed` is `qweight` transposed and
`weight_scale` is `scales` transposed: no repacking, no new kernel. This module turns a
GPTQ checkpoint's tensor names and tensors into those, checking the zero points and
`g_idx` on the way (a nonzero offset or a reordered `g_idx` is an error naming the
tensor: the W4A16 kernels have neither zero points nor reordering).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

SYMMETRIC_ZERO = 8
# GPTQ tensor suffix -> the compressed-tensors tensor it becomes (None: checked, dropped).
RENAMED = {"qweight": "weight_packed", "scales": "weight_scale", "qzeros": None, "g_idx": None}
NEEDED = ("qweight", "scales", "qzeros")


def _split(name: str) -> tuple[str, str]:
    module, _, suffix = name.rpartition(".")
    return module, suffix


def gptq_modules(keys: Iterable[str]) -> set[str]:
    """The checkpoint modules GPTQ quantized: those with a `qweight`."""
    return {module for module, suffix in map(_split, keys) if suffix == "qweight"}


def gptq_keys(keys: Iterable[str]) -> list[str]:
    """The checkpoint's tensor names as `gptq_tensors` yields them."""
    keys = list(keys)
    quantized = gptq_modules(keys)
    out = []
    for key in keys:
        module, suffix = _split(key)
        if module not in quantized or suffix not in RENAMED:
            out.append(key)
        elif RENAMED[suffix] is not None:
            out.append(f"{module}.{RENAMED[suffix]}")
            if suffix == "qweight":
                out.append(f"{module}.weight_shape")
    return out


def _unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """[R, C / 8] int32 -> [R, C] nibbles (lowest first) as int64."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    return ((packed.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF).flatten(-2)


def _check_int32(name: str, tensor: torch.Tensor, dims: int) -> None:
    if tensor.dtype != torch.int32 or tensor.dim() != dims:
        raise ValueError(
            f"{name}: expected a {dims}-D int32 tensor, got {tensor.dtype} {list(tensor.shape)}"
        )


class GptqReader:
    """Turns a GPTQ checkpoint's tensors into W4A16 ones (`__call__`), one module at a
    time as its `qweight`, `scales` and `qzeros` arrive; `finish()` names any module
    whose tensors did not all arrive."""

    def __init__(self, group_size: int, stored_zero: int):
        self.group_size = group_size
        self.stored_zero = stored_zero  # what the checkpoint stores for z = 8
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator:
        for name, tensor in weights:
            module, suffix = _split(name)
            if suffix not in RENAMED:
                yield name, tensor
                continue
            if suffix == "g_idx":
                self._check_g_idx(name, tensor)
                continue
            parts = self.pending.setdefault(module, {})
            parts[suffix] = tensor
            if all(s in parts for s in NEEDED):
                yield from self._convert(module, self.pending.pop(module))
        self.finish()

    def finish(self) -> None:
        for module, parts in self.pending.items():
            missing = [s for s in NEEDED if s not in parts]
            raise ValueError(
                f"{module}.{missing[0]}: missing from the GPTQ checkpoint (a GPTQ layer "
                f"needs {', '.join(NEEDED)}; found {', '.join(sorted(parts))})"
            )

    def _check_g_idx(self, name: str, g_idx: torch.Tensor) -> None:
        if g_idx.dtype not in (torch.int32, torch.int64) or g_idx.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D int32 tensor, got {g_idx.dtype}")
        want = torch.arange(g_idx.numel(), dtype=torch.int64) // self.group_size
        if not torch.equal(g_idx.to(torch.int64), want):
            raise ValueError(
                f"{name}: input features are reordered (activation order, desc_act); "
                f"kvloom reads GPTQ checkpoints whose g_idx is k // group_size "
                f"({self.group_size})"
            )

    def _convert(self, module: str, parts: dict[str, torch.Tensor]) -> Iterator:
        qweight, scales, qzeros = (parts[s] for s in NEEDED)
        _check_int32(f"{module}.qweight", qweight, 2)
        _check_int32(f"{module}.qzeros", qzeros, 2)
        k, n = qweight.shape[0] * 8, qweight.shape[1]
        groups = k // self.group_size
        if k % self.group_size:
            raise ValueError(
                f"{module}.qweight: {k} input features are not a multiple of group_size "
                f"{self.group_size}"
            )
        if not scales.dtype.is_floating_point or tuple(scales.shape) != (groups, n):
            raise ValueError(
                f"{module}.scales: expected a float [{groups}, {n}] tensor (group_size "
                f"{self.group_size}), got {scales.dtype} {list(scales.shape)}"
            )
        if tuple(qzeros.shape) != (groups, -(-n // 8)):
            raise ValueError(
                f"{module}.qzeros: expected [{groups}, {-(-n // 8)}], got {list(qzeros.shape)}"
            )
        zeros = _unpack_columns(qzeros)[:, :n]
        off = zeros != self.stored_zero
        if off.any():
            group, col = (int(i) for i in off.nonzero()[0])
            raise ValueError(
                f"{module}.qzeros: group {group}, column {col} stores zero point "
                f"{int(zeros[group, col])} where a symmetric checkpoint stores "
                f"{self.stored_zero}; kvloom reads symmetric GPTQ (sym: true) only"
            )
        yield f"{module}.weight_packed", qweight.t().contiguous()
        yield f"{module}.weight_scale", scales.t().contiguous()
        yield f"{module}.weight_shape", torch.tensor([n, k], dtype=torch.int64)
