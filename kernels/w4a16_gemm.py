"""W4A16 GEMM: int4 weights, group-quantized and symmetric, times half/float activations.
The pure-torch reference (dequantize, then matmul).

Layout (compressed-tensors `pack-quantized`, as its `pack_to_int32` writes it): the int4
value q in [-8, 7] is stored offset by 8 (0..15); eight consecutive input features share
one int32, feature j at bits 4 * (j % 8) of word j // 8 (lowest nibble first), so
`packed` is [N, K / 8] int32. `scale` [N, K / group_size] holds one scale per output row
and input group; the weight is w[n, k] = q[n, k] * scale[n, k // group_size].

Rounding points (the Triton kernels have the same): q * scale is formed in float32 and
rounded once to the activation dtype, as a half-precision GEMM holds its operand; the dot
accumulates in float32; the result is rounded once to the activation dtype.
"""

from __future__ import annotations

import torch

PACK_FACTOR = 8  # int4 values per int32
INT4_OFFSET = 8


def check_w4_args(packed: torch.Tensor, scale: torch.Tensor, in_features: int, group_size: int):
    """Shapes of one [N, K] weight (or an [E, N, K] stack); returns N."""
    if packed.dtype != torch.int32:
        raise ValueError(f"weight_packed: expected int32, got {packed.dtype}")
    if in_features % PACK_FACTOR:
        raise ValueError(f"input width ({in_features}) must be a multiple of {PACK_FACTOR}")
    if in_features % group_size:
        raise ValueError(f"group_size ({group_size}) must divide the input width ({in_features})")
    if packed.shape[-1] != in_features // PACK_FACTOR:
        raise ValueError(
            f"weight_packed: expected last dim {in_features // PACK_FACTOR} "
            f"(= {in_features} / {PACK_FACTOR}), got shape {list(packed.shape)}"
        )
    want = (*packed.shape[:-1], in_features // group_size)
    if tuple(scale.shape) != want:
        raise ValueError(f"weight_scale: expected shape {list(want)}, got {list(scale.shape)}")
    return packed.shape[-2]


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """[..., K / 8] int32 -> [..., K] int8 in [-8, 7]."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (nibbles.flatten(-2)[..., :in_features] - INT4_OFFSET).to(torch.int8)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[..., K] integers in [-8, 7] -> [..., K / 8] int32 (test and checkpoint writer)."""
    if q.shape[-1] % PACK_FACTOR:
        raise ValueError(f"input width ({q.shape[-1]}) must be a multiple of {PACK_FACTOR}")
    if q.numel() and (int(q.min()) < -INT4_OFFSET or int(q.max()) > INT4_OFFSET - 1):
        raise ValueError("values must be in [-8, 7]")
    nibbles = (q.to(torch.int64) + INT4_OFFSET).unflatten(-1, (-1, PACK_FACTOR))
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    words = (nibbles << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def dequantize_w4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    group_size: int,
    dtype: torch.dtype,
    offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """[..., N, K / 8] + [..., N, K / g] -> [..., N, K] in `dtype` (rounded once).
    `offset` (float32, the scale's shape): zero points as s * z, the weight q * s - o."""
    in_features = packed.shape[-1] * PACK_FACTOR
    q = unpack_int4(packed, in_features).float()
    w = q * scale.float().repeat_interleave(group_size, dim=-1)
    if offset is not None:
        w = w - offset.float().repeat_interleave(group_size, dim=-1)
    return w.to(dtype)


def w4a16_linear_ref(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N] in `out_dtype` (default x's dtype)."""
    k = x.shape[-1]
    n = check_w4_args(packed, scale, k, group_size)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = dequantize_w4(packed, scale, group_size, x.dtype).to(acc)
    out = x.reshape(-1, k).to(acc) @ w.T
    if bias is not None:
        out = out + bias.to(acc)
    return out.to(out_dtype or x.dtype).view(*x.shape[:-1], n)
