"""GPTQ and AWQ int4 checkpoints, read as W4A16 (`Int4Reader`).

GPTQ (`quant_method: "gptq"`, AutoGPTQ / GPTQModel).

A symmetric GPTQ layer without activation reordering (`sym: true`, `desc_act: false`) is
the same weight as compressed-tensors' `pack-quantized` layout that the W4A16 kernels run,
stored transposed:

* `qweight` int32 [K / 8, N]: eight consecutive input features per word, feature k at
  bits 4 * (k % 8), lowest nibble first, as unsigned values u in [0, 15];
* `scales` float16 [K / g, N]; `qzeros` int32 [K / g, N / 8] (packed along N), the zero
  point z of each group and output column; `g_idx` int32 [K] (optional) the group of
  each input feature;
* w[n, k] = scales[k // g, n] * (u[k, n] - z). GPTQ's original format ("gptq") stores
  z - 1, its v2 format ("gptq_v2") z itself. (A v1 zero point of 0 has no encoding: it
  wraps to 15 and reads back as 16, as GPTQ's own kernels add 1 to the stored value.)

With z = 8 for every group (what `sym: true` writes), u - 8 is compressed-tensors' signed
value and u its stored nibble, so `weight_packed` is `qweight` transposed and
`weight_scale` is `scales` transposed: no repacking, no new kernel. This module turns a
GPTQ checkpoint's tensor names and tensors into those, checking the zero points and
`g_idx` on the way (a zero point other than 8 or a reordered `g_idx` is an error naming
the tensor). An asymmetric layer (`sym: false`) keeps its zero points as AWQ's do, below:
`weight_offset` = s * (z - 8), and the same `weight_packed` (u is still q + 8's nibble).
A reordered `g_idx` stays an error: the W4A16 kernels do not reorder.

AWQ (`quant_method: "awq"`, AutoAWQ's GEMM layout, `version: "gemm"`): `qweight` int32
[K, N / 8] and `qzeros` int32 [K / g, N / 8] packed along N, nibble i of a word holding
column 8 * word + AWQ_ORDER[i]; `scales` float16 [K / g, N]; w[n, k] = (u - z) * s with
any z in [0, 15]. It becomes pack-quantized's `weight_packed` (u - 8, repacked along K) and
`weight_scale`, plus `weight_offset` [N, K / g] = s * (z - 8) in float32, which the
zero-point W4A16 method subtracts as a per-group correction (methods.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kvloom.kernels.w4a16_gemm import INT4_OFFSET, pack_int4

# Checkpoint tensor suffix -> the W4A16 tensor it becomes (None: checked, dropped), by
# (method, zero points kept).
RENAMED = {
    ("gptq", False): {
        "qweight": "weight_packed", "scales": "weight_scale", "qzeros": None, "g_idx": None
    },
    ("gptq", True): {
        "qweight": "weight_packed", "scales": "weight_scale", "qzeros": "weight_offset",
        "g_idx": None,
    },
    ("awq", True): {"qweight": "weight_packed", "scales": "weight_scale", "qzeros": "weight_offset"},
}  # fmt: skip
NEEDED = ("qweight", "scales", "qzeros")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i]


def _split(name: str) -> tuple[str, str]:
    module, _, suffix = name.rpartition(".")
    return module, suffix


def qweight_modules(keys: Iterable[str]) -> set[str]:
    """The checkpoint modules GPTQ or AWQ quantized: those with a `qweight`."""
    return {module for module, suffix in map(_split, keys) if suffix == "qweight"}


def int4_keys(keys: Iterable[str], method: str, zero_points: bool) -> list[str]:
    """The checkpoint's tensor names as `Int4Reader(method, ..., zero_points)` yields them."""
    keys, renamed = list(keys), RENAMED[method, zero_points]
    quantized = qweight_modules(keys)
    out = []
    for key in keys:
        module, suffix = _split(key)
        if module not in quantized or suffix not in renamed:
            out.append(key)
        elif renamed[suffix] is not None:
            out.append(f"{module}.{renamed[suffix]}")
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


class Int4Reader:
    """Turns a GPTQ or AWQ checkpoint's tensors into W4A16 ones (`__call__`), one module
    at a time as its `qweight`, `scales` and `qzeros` arrive; `finish()` names any module
    whose tensors did not all arrive. `stored_zero`: what a GPTQ checkpoint stores for
    z = 8. `zero_points`: keep them as `weight_offset` (AWQ; GPTQ with `sym: false`), else
    (symmetric GPTQ) check that every one is 8."""

    def __init__(
        self,
        method: str,
        group_size: int,
        stored_zero: int | None = None,
        zero_points: bool | None = None,
    ):
        self.method = method
        self.group_size = group_size
        self.stored_zero = stored_zero
        self.zero_points = method == "awq" if zero_points is None else zero_points
        self.renamed = RENAMED[method, self.zero_points]
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator:
        for name, tensor in weights:
            module, suffix = _split(name)
            if suffix not in self.renamed:
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
                f"{module}.{missing[0]}: missing from the {self.method.upper()} checkpoint (a layer "
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
        if self.method == "gptq":  # [K / 8, N]
            k, n = qweight.shape[0] * 8, qweight.shape[1]
        else:  # AWQ: [K, N / 8]
            k, n = qweight.shape[0], qweight.shape[1] * 8
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
        if self.method == "gptq":
            yield from self._gptq(module, qweight, scales, qzeros, n)
        else:
            yield from self._awq(module, qweight, scales, qzeros)
        yield f"{module}.weight_shape", torch.tensor([n, k], dtype=torch.int64)

    def _gptq(self, module, qweight, scales, qzeros, n) -> Iterator:
        zeros = _unpack_columns(qzeros)[:, :n]  # [K / g, N]
        if self.zero_points:  # z - 8 = stored - stored_zero (v1 stores z - 1: 7 for z = 8)
            yield f"{module}.weight_packed", qweight.t().contiguous()
            yield f"{module}.weight_scale", scales.t().contiguous()
            yield f"{module}.weight_offset", _offset(zeros - self.stored_zero, scales)
            return
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

    def _awq(self, module, qweight, scales, qzeros) -> Iterator:
        values = _unpack_awq(qweight)  # [K, N] in [0, 15]
        yield f"{module}.weight_packed", pack_int4(values.t() - INT4_OFFSET)
        yield f"{module}.weight_scale", scales.t().contiguous()
        yield f"{module}.weight_offset", _offset(_unpack_awq(qzeros) - INT4_OFFSET, scales)


def _offset(shifted_zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(z - 8) [K / g, N] and the scales -> weight_offset [N, K / g] float32 = s * (z - 8)."""
    return (shifted_zeros.to(torch.float32) * scales.to(torch.float32)).t().contiguous()


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[R, C / 8] int32 in AWQ's column order -> [R, C] int64 in natural order."""
    nibbles = _unpack_columns(packed).unflatten(-1, (-1, 8))
    natural = torch.empty_like(nibbles)
    natural[..., list(AWQ_ORDER)] = nibbles
    return natural.flatten(-2)
