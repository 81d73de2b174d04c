"""Kimi Delta Attention prefill through fla-core's chunked Triton kernels (CUDA).

Same contract as `kda.chunk_kda` (packed token-major layout, log-decay g per key channel
computed outside the kernel by `kda_log_decay`, beta already a sigmoid, NaN-safe
`has_initial_state` selection); only the computation moves to `fla.ops.kda.chunk_kda`, the
kernels Kimi-Linear's own modeling code calls when fla is installed, in place of the torch
reference's chunked loop. The gate stays outside (`use_gate_in_kernel=False`), as the
reference has it.

Opt-in on CUDA (`KVLOOM_KDA_FLA=1`) until a GPU run checks it against the reference
(`tests/test_kda_fla.py`, marked gpu). fla is imported only when called.
"""

from __future__ import annotations

import torch

from kvloom.kernels.gated_delta_rule import (
    check_floating,
    check_heads,
    check_shape,
    cu_seqlens_to_list,
    select_initial_state,
)
from kvloom.kernels.gated_delta_rule_fla import FLA_DTYPES


def chunk_kda_fla(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kda.chunk_kda` on fla's kernels. q, k [T, Hk, Dk]; v [T, Hv, Dv]; g [T, Hv, Dk]
    (log-decay, <= 0); beta [T, Hv]; cu_seqlens [N+1]; initial_state [N, Hv, Dk, Dv] read
    only where has_initial_state [N]. Returns (out [T, Hv, Dv] in q's dtype, final_state
    [N, Hv, Dk, Dv] float32, or initial_state's dtype when given)."""
    num_tokens, num_v_heads, head_k, head_v = check_heads(q, k, v)
    check_shape("g", g, (num_tokens, num_v_heads, head_k))
    check_shape("beta", beta, (num_tokens, num_v_heads))
    check_floating("g", g)
    check_floating("beta", beta)
    if q.dtype not in FLA_DTYPES:
        raise ValueError(f"q: fla takes float16/bfloat16/float32, got {q.dtype}")
    bounds = cu_seqlens_to_list(cu_seqlens, num_tokens)
    shape = (len(bounds) - 1, num_v_heads, head_k, head_v)
    state = select_initial_state(initial_state, has_initial_state, shape, torch.float32, q.device)
    final_dtype = torch.float32 if initial_state is None else initial_state.dtype
    if num_tokens == 0:  # nothing to launch; every sequence keeps its starting state
        return v.new_zeros(v.shape, dtype=q.dtype), state.to(final_dtype)

    from fla.ops.kda import chunk_kda

    cu_cpu = torch.tensor(bounds, dtype=torch.int64)
    # fla's varlen form: a batch of one holding all packed tokens, sequences cut by cu_seqlens.
    out, final_state = chunk_kda(
        q.unsqueeze(0),
        k.to(q.dtype).unsqueeze(0),
        v.to(q.dtype).unsqueeze(0),
        g.float().unsqueeze(0),
        beta.unsqueeze(0),
        scale=head_k**-0.5 if scale is None else scale,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        cu_seqlens=cu_cpu.to(q.device),
        cu_seqlens_cpu=cu_cpu,  # lets fla lay out chunks without a device-to-host copy
    )
    return out.squeeze(0).to(q.dtype), final_state.to(final_dtype)
