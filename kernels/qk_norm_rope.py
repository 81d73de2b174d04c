"""Per-head q/k RMSNorm followed by rotary embedding: the pure-torch reference.

The attention layers of Qwen3 (and Qwen3-Next, with (1 + w) norms) normalise every query
and key head over its head dim, then rotate both with the positions' cos/sin; Llama and
Qwen2 only rotate. The reference is literally that composition of the two existing
references, `rms_norm_ref` then `apply_rotary_ref`, so the fused Triton kernel beside it
(`qk_norm_rope_triton`) is held to exactly their semantics and rounding points.
`qk_norm_rope_kv_write_ref` adds the paged-cache write of the finished keys and the values
(`write_kv_cache_ref`), which the Triton kernel does in the same launch.
"""

from __future__ import annotations

import torch

from kvloom.kernels.kv_cache_write import write_kv_cache_ref
from kvloom.kernels.rms_norm import rms_norm_ref
from kvloom.kernels.rotary import apply_rotary_ref


def qk_norm_rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    rotary_dim: int | None = None,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D]; positions: [T]; cos/sin tables: [max_pos, rotary_dim // 2].

    A weight of None skips that tensor's norm (rotary only). `weight_offset=1` scales by
    (1 + w). Only the first `rotary_dim` dims (default D) rotate, neox half-split layout.
    Returns new contiguous (q_out, k_out) in the inputs' dtypes.
    """
    if q_weight is not None:
        q = rms_norm_ref(q, q_weight, eps, weight_offset=weight_offset)[0]
    if k_weight is not None:
        k = rms_norm_ref(k, k_weight, eps, weight_offset=weight_offset)[0]
    cos, sin = cos_table[positions], sin_table[positions]
    return apply_rotary_ref(q, cos, sin, rotary_dim), apply_rotary_ref(k, cos, sin, rotary_dim)


def qk_norm_rope_kv_write_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    rotary_dim: int | None,
    weight_offset: float,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`qk_norm_rope_ref`, then the finished keys and v [T, Hk, D] written into kv_cache at
    slot_mapping (slot < 0: not written). Returns (q_out, k_out)."""
    args = (q, k, positions, cos_table, sin_table, q_weight, k_weight, eps, rotary_dim)
    q_out, k_out = qk_norm_rope_ref(*args, weight_offset)
    write_kv_cache_ref(k_out, v, kv_cache, slot_mapping, k_scale, v_scale)
    return q_out, k_out
