"""Rotary position embedding with default, linear and Llama-3 frequency scaling.

cos/sin are tabulated once in float32 (as Hugging Face computes them) and gathered by
position each step.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvloom.kernels.ops import apply_rotary, qk_norm_rope, qk_norm_rope_try_kv_write


def rope_parameters(config: dict) -> dict:
    """Rope settings from either transformers 5's `rope_parameters` or the legacy keys."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def inverse_frequencies(rotary_dim: int, params: dict) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (
        base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    )
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_type {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, rotary_dim: int, max_position: int, params: dict):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = inverse_frequencies(rotary_dim, params)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D] -> rotated copies."""
        cos, sin = self.cos[positions], self.sin[positions]
        return (
            apply_rotary(q, cos, sin, self.rotary_dim),
            apply_rotary(k, cos, sin, self.rotary_dim),
        )

    def norm_and_rotate(self, positions, q, k, q_norm=None, k_norm=None):
        """The q/k RMSNorms (modules, or None) and the rotation, fused in one kernel."""
        return qk_norm_rope(q, k, positions, *self._kernel_args(q_norm, k_norm))

    def norm_rotate_try_cache(self, positions, q, k, v, cache, q_norm=None, k_norm=None):
        """`norm_and_rotate`, also storing the rotated keys and v [T, Hkv, D] in the paged
        cache (`cache`: the layer's `PagedAttention.cache_write(batch)`) where one launch
        can do both (decode on CUDA: kernels/ops.qk_norm_rope_try_kv_write). Returns
        (q, k, cache_written); when False, PagedAttention writes the cache as before."""
        args = self._kernel_args(q_norm, k_norm)
        return qk_norm_rope_try_kv_write(q, k, v, positions, *args, *cache)

    def _kernel_args(self, q_norm, k_norm) -> tuple:
        """qk_norm_rope's arguments after q, k and positions: the tables, the norms' weights
        (None: rotary only), eps, rotary_dim and weight_offset."""
        if (q_norm is None) != (k_norm is None):
            raise ValueError("q_norm and k_norm: give both or neither")
        weights = (None, None) if q_norm is None else (q_norm.weight, k_norm.weight)
        eps = 1e-6 if q_norm is None else q_norm.eps
        offset = 0.0 if q_norm is None else q_norm.weight_offset
        return self.cos, self.sin, *weights, eps, self.rotary_dim, offset
