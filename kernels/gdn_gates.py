"""Gated DeltaNet gates (Qwen3-Next): g and beta from the in_proj_ba output, the reference.

in_proj_ba writes, per key-head group, r values of b then r values of a (r = Hv / Hk value
heads per key head; transformers' `fix_query_key_value_ordering`), so value head
hv = group * r + j reads b at column group * 2r + j and a at column group * 2r + r + j.

  g[t, hv]    = -exp(A_log[hv]) * softplus(a[t, hv] + dt_bias[hv])  (float32; float64 for
                float64 input; softplus with beta 1 and threshold 20, as torch's)
  beta[t, hv] = sigmoid(b[t, hv])  (in ba's dtype: computed in float32, rounded once)

`gdn_gates_ref` is bit for bit what `GatedDeltaNet._split_projections` and `._gates` in
workers/layers/gated_deltanet.py compute; `gdn_gates_triton` is the one-launch kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_gdn_gates_args(ba, A_log, dt_bias, group_v_heads) -> tuple[int, int, int]:
    """ba [T, Hk * 2r], A_log [Hv], dt_bias [Hv] with Hv = Hk * r. Returns (T, Hk, Hv)."""
    for name, value in (("ba", ba), ("A_log", A_log), ("dt_bias", dt_bias)):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
        if value.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}: expected a floating dtype, got {value.dtype}")
    r = group_v_heads
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"group_v_heads must be a positive int, got {r!r}")
    if ba.dim() != 2 or ba.shape[1] % (2 * r):
        raise ValueError(
            f"ba: expected [T, Hk * 2 * {r}] (b then a per key-head group), "
            f"got shape {list(ba.shape)}"
        )
    num_k_heads = ba.shape[1] // (2 * r)
    num_v_heads = num_k_heads * r
    for name, value in (("A_log", A_log), ("dt_bias", dt_bias)):
        if tuple(value.shape) != (num_v_heads,):
            raise ValueError(f"{name}: expected shape [{num_v_heads}], got {list(value.shape)}")
    return ba.shape[0], num_k_heads, num_v_heads


def gdn_gates_ref(
    ba: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, group_v_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (g [T, Hv] float32 (float64 for float64 ba), beta [T, Hv] in ba's dtype)."""
    tokens, num_k_heads, num_v_heads = check_gdn_gates_args(ba, A_log, dt_bias, group_v_heads)
    r = group_v_heads
    b, a = ba.reshape(tokens, num_k_heads, 2 * r).split([r, r], dim=-1)
    b, a = b.reshape(tokens, num_v_heads), a.reshape(tokens, num_v_heads)
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    g = -A_log.to(acc).exp() * F.softplus(a.to(acc) + dt_bias.to(acc))
    return g, b.sigmoid()
