"""Kimi Delta Attention prefill through fla-core's chunked Triton kernels (CUDA).

Same contract as `kda.chunk_kda` (packed token-major layout, log-decay g per key channel
computed outside the kernel by `kda_log_decay`, beta already a sigmoid, NaN-safe
`has_initial_state` selection); only the computation moves to `fla.ops.kda.chunk_kda`, the
kernels Kimi-Linear's own modeling code calls when fla is installed, in place of the torch
reference's chunked loop. The gate stays outside (`use_gate_in_kernel=False`), as the
reference has it.

The default on CUDA when fla is installed (`KVLOOM_NO_FLA=1` turns it off): on an H200 it
matched the reference at Kimi-Linear's shape in bf16 and float32, with and without initial
states (`tests/test_kda_fla.py`, marked gpu). fla is imported only when called.

fla's chunk layout comes from `KVLOOM_FLA_LAYOUT` (kernels/fla_chunk_layout.py); with
`staged`, fla's forward (`chunk_kda_fwd`) is called directly, since chunk_kda takes no
layout.
"""

from __future__ import annotations

import importlib

import torch

from kvloom.kernels.fla_chunk_layout import FLA_CHUNK, fla_layout
from kvloom.kernels.gated_delta_rule import check_floating, check_heads, check_shape
from kvloom.kernels.gated_delta_rule_fla import run_fla_varlen


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
    cu_seqlens_device: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kda.chunk_kda` on fla's kernels. q, k [T, Hk, Dk]; v [T, Hv, Dv]; g [T, Hv, Dk]
    (log-decay, <= 0); beta [T, Hv]; cu_seqlens [N+1]; initial_state [N, Hv, Dk, Dv] read
    only where has_initial_state [N]. Returns (out [T, Hv, Dv] in q's dtype, final_state
    [N, Hv, Dk, Dv] float32, or initial_state's dtype when given). `cu_seqlens_device`: the
    same bounds on q's device (`gated_delta_rule_fla.run_fla_varlen`)."""
    num_tokens, num_v_heads, head_k, _ = check_heads(q, k, v)
    check_shape("g", g, (num_tokens, num_v_heads, head_k))
    check_shape("beta", beta, (num_tokens, num_v_heads))
    check_floating("g", g)
    check_floating("beta", beta)
    layout = fla_layout()
    load = _staged_kernel if layout == "staged" else _fla_kernel
    return run_fla_varlen(
        load, q, k, v, g, beta, cu_seqlens, initial_state, has_initial_state, scale,
        use_qk_l2norm, cu_seqlens_device, layout=layout,
    )  # fmt: skip


def _fla_kernel():
    return importlib.import_module("fla.ops.kda").chunk_kda


def _staged_kernel():
    return staged_chunk_kda


def staged_chunk_kda(q, k, v, g, beta, *, scale, initial_state, output_final_state,
                     use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, chunk_indices,
                     chunk_offsets):  # fmt: skip
    """fla's KDA forward (`fla.ops.kda.chunk_fwd.chunk_kda_fwd`, the body of chunk_kda) on
    a staged chunk layout: chunk_kda's checks are run_fla_varlen's, and its autograd
    wrapper has nothing to do at inference. chunk_kda's arguments as run_fla_varlen passes
    them, plus the layout; returns (out, final_state)."""
    if use_qk_l2norm_in_kernel:
        raise ValueError("use_qk_l2norm_in_kernel: q and k reach fla normalised")
    forward = importlib.import_module("fla.ops.kda.chunk_fwd").chunk_kda_fwd
    out, final_state, *_ = forward(
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
        chunk_offsets=chunk_offsets, chunk_size=FLA_CHUNK,
    )  # fmt: skip
    return out, final_state
