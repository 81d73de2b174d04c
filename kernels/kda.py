"""Kimi Delta Attention (KDA, Kimi-Linear): pure-torch reference kernels.

KDA is the gated delta rule with one decay per key channel: g has shape [..., H, Dk] instead
of [..., H], and the state's key rows decay independently,

    S <- diag(exp(g)) S ;  S <- S + k (beta * (v - S^T k))^T ;  o = S^T (scale * q)

This matches transformers' `chunk_kimi_delta_attention` / `recurrent_kimi_delta_attention`
(Kimi-Linear torch fallback). Layouts, dtypes, varlen, initial-state and state-pool
conventions are those of `gated_delta_rule.py`, whose chunked core this module shares.

The gate is OUTSIDE the kernel, as in transformers: the kernels take the log-decay g; the
layer computes it with `kda_log_decay` (g = -exp(A_log) * softplus(raw + dt_bias)).
"""

import torch
import torch.nn.functional as F

from kvloom.kernels.gated_delta_rule import check_heads, check_shape, run_chunked, run_decode_step


def kda_log_decay(
    raw_gate: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> torch.Tensor:
    """Kimi-Linear forget gate: [..., H, Dk] raw projections -> log-decay g (float32, or float64
    for float64 input). A_log holds one value per head (any shape with H elements), dt_bias one
    per channel ([H * Dk] or [H, Dk]). softplus is linear above 20, as transformers has it."""
    if raw_gate.dim() < 2:
        raise ValueError(f"raw_gate: expected [..., H, Dk], got {list(raw_gate.shape)}")
    heads, head_k = raw_gate.shape[-2:]
    if A_log.numel() != heads:
        raise ValueError(f"A_log: expected {heads} values (one per head), got {A_log.numel()}")
    if dt_bias.numel() != heads * head_k:
        raise ValueError(f"dt_bias: expected {heads * head_k} values, got {dt_bias.numel()}")
    dtype = torch.float64 if raw_gate.dtype == torch.float64 else torch.float32
    shifted = raw_gate.to(dtype) + dt_bias.to(dtype).reshape(heads, head_k)
    return -A_log.to(dtype).reshape(heads, 1).exp() * F.softplus(shifted, beta=1.0, threshold=20.0)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA over N packed sequences. q, k [T, Hk, Dk]; v [T, Hv, Dv]; g (log-decay, <= 0)
    [T, Hv, Dk]; beta [T, Hv]; the rest as `chunk_gated_delta_rule`.
    Returns (out [T, Hv, Dv], final_state [N, Hv, Dk, Dv])."""
    num_tokens, num_v_heads, head_k, _ = check_heads(q, k, v)
    check_shape("g", g, (num_tokens, num_v_heads, head_k))
    check_shape("beta", beta, (num_tokens, num_v_heads))
    return run_chunked(
        q,
        k,
        v,
        g,
        beta,
        cu_seqlens,
        initial_state,
        has_initial_state,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        chunk_size=chunk_size,
    )


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> torch.Tensor:
    """One KDA decode step per sequence; g is [N, Hv, Dk], the rest as
    `recurrent_gated_delta_rule` (pool updated in place, negative index = padding row)."""
    num_rows, num_v_heads, head_k, _ = check_heads(q, k, v)
    check_shape("g", g, (num_rows, num_v_heads, head_k))
    check_shape("beta", beta, (num_rows, num_v_heads))
    return run_decode_step(
        q, k, v, g, beta, state, state_indices, scale=scale, use_qk_l2norm=use_qk_l2norm
    )
