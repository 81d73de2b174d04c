"""The deterministic mode's batch-invariant kernels: torch references and selection.

`deterministic=True` promises that a request's tokens do not depend on what else is
batched, how its prompt was chunked, prefix-cache hits or preemption. That needs one
summation order per output element whatever the batch (kernels/dispatch.batch_invariant()
says whether the mode is on in this process):

* linear layers (LM head, routers and gates included): `linear`, one GEMM tile shape for
  every row count, no split-K, no GEMV fast path (batch_invariant_triton.matmul_triton);
* paged attention: `attention_plan`, ONE plan for decode rows and prefill chunks alike,
  whose key tiles sit on a grid of absolute positions, so a query token sums the same
  tiles in the same order whether it is computed in a prefill chunk, after a prefix hit,
  in a decode step or in a recompute after preemption; no split-KV;
* Gated DeltaNet (Qwen3-Next): `serial_causal_conv1d` and `serial_gated_delta_rule` run
  prefill chunks and decode steps through one token-by-token loop (the chunked prefill
  algorithm sums in an order that depends on chunk boundaries, so it is not used);
* RMSNorm, gated RMSNorm, q/k-norm+rope, the fused MoE, greedy argmax and the per-row
  softmaxes of the sampler are invariant already (one program per row or a plan from the
  model's shape only; see their modules).

The references have the same semantics; on the CPU they are what the mode runs (rows of a
linear one at a time, so every row is the same M = 1 call).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvloom.kernels import causal_conv1d as conv_ref
from kvloom.kernels import gated_delta_rule as gdn_ref
from kvloom.kernels import kda as kda_ref
from kvloom.kernels.dispatch import use_triton


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """y = x W^T (+ bias), one row at a time: every row is computed by the same call."""
    flat = x.reshape(-1, x.shape[-1])
    rows = [F.linear(flat[i : i + 1], weight, bias) for i in range(flat.shape[0])]
    out = torch.cat(rows) if rows else flat.new_empty((0, weight.shape[0]))
    return out.view(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """The mode's linear: the fixed-tile Triton GEMM on CUDA, else `linear_ref`."""
    if use_triton(x) and weight.dtype == x.dtype:
        from kvloom.kernels.batch_invariant_triton import matmul_triton

        out = matmul_triton(x.reshape(-1, x.shape[-1]), weight, bias)
        return out.view(*x.shape[:-1], weight.shape[0])
    return linear_ref(x, weight, bias)


def attention_plan(group: int, head_dim: int, dtype: torch.dtype) -> dict:
    """The one paged-attention plan for every row: the prefill (long-row) plan of
    `paged_attention_triton._plans`, which depends on the model's shape only."""
    from kvloom.kernels.paged_attention_triton import _plans

    return dict(_plans(group, head_dim, dtype)[1])


def _zero_fresh_slots(pool, slots, has_state, cu_seqlens):
    """Clears the pages of rows that start fresh this step (NaN-safe: selected, not
    multiplied); padding rows and rows without tokens keep theirs."""
    used = (slots >= 0) & (cu_seqlens[1:] > cu_seqlens[:-1]).to(slots.device)
    pages = torch.where(used, slots, 0).to(torch.int64)
    keep = (has_state | ~used).view(-1, *([1] * (pool.dim() - 1)))
    pool[pages] = torch.where(keep, pool[pages], torch.zeros_like(pool[pages]))


def _steps(cu_seqlens: torch.Tensor):
    """(token index, row index) of step j of every row longer than j, j = 0, 1, ..."""
    bounds = cu_seqlens.tolist()
    starts, lens = bounds[:-1], [b - a for a, b in zip(bounds, bounds[1:])]
    for j in range(max(lens, default=0)):
        rows = [i for i, n in enumerate(lens) if n > j]
        yield [starts[i] + j for i in rows], rows


def serial_causal_conv1d_ref(
    x, weight, bias, conv_state_pool, cu_seqlens, state_indices, has_initial_state, activation
):
    """Token by token through `causal_conv1d_update`, in place on the pool."""
    _zero_fresh_slots(conv_state_pool, state_indices, has_initial_state, cu_seqlens)
    out = x.new_zeros(x.shape)
    for tokens, rows in _steps(cu_seqlens):
        step = conv_ref.causal_conv1d_update(
            x[tokens], weight, bias, conv_state_pool, state_indices[rows], activation
        )
        out[tokens] = step
    return out


def _serial_recurrence_ref(
    step, q, k, v, g, beta, state, cu_seqlens, state_indices, has_initial_state, scale,
    use_qk_l2norm, round_every_token=True,
):  # fmt: skip
    """Token by token through the single-step reference `step`, in place on the pool
    (without `round_every_token`, a half-precision pool's rows on float32 copies of their
    pages, stored once; a float32 or float64 pool needs no copy)."""
    _zero_fresh_slots(state, state_indices, has_initial_state, cu_seqlens)
    pool, rows_of = state, state_indices
    if not round_every_token and state.dtype in (torch.float16, torch.bfloat16):
        pages = state_indices.clamp(min=0).to(torch.int64)
        pool = state[pages].float()  # row i's state at index i
        ids = torch.arange(len(pages), device=state_indices.device)
        rows_of = torch.where(state_indices >= 0, ids, -1)
    out = v.new_zeros(v.shape)
    for tokens, rows in _steps(cu_seqlens):
        out[tokens] = step(
            q[tokens], k[tokens], v[tokens], g[tokens], beta[tokens], pool,
            rows_of[rows], scale=scale, use_qk_l2norm=use_qk_l2norm,
        )  # fmt: skip
    if pool is not state:
        used = (state_indices >= 0) & (cu_seqlens[1:] > cu_seqlens[:-1]).to(pages.device)
        state[pages[used]] = pool[used].to(state.dtype)
    return out


def serial_gated_delta_rule_ref(*args, round_every_token=True):
    """Token by token through `recurrent_gated_delta_rule` (arguments as
    `serial_gated_delta_rule`'s, scale and use_qk_l2norm positional), in place on the pool."""
    return _serial_recurrence_ref(
        gdn_ref.recurrent_gated_delta_rule, *args, round_every_token=round_every_token
    )


def serial_kda_ref(*args, round_every_token=True):
    """Token by token through `kda.recurrent_kda` (arguments as `serial_kda`'s, scale and
    use_qk_l2norm positional), in place on the pool."""
    return _serial_recurrence_ref(kda_ref.recurrent_kda, *args, round_every_token=round_every_token)


def serial_causal_conv1d(
    x, weight, bias, conv_state_pool, cu_seqlens, state_indices, has_initial_state, activation,
    token_parallel: bool = False,
):  # fmt: skip
    """Depthwise causal conv over packed rows, each continuing its pool slot in place.

    x [T, C]; cu_seqlens [N+1] (row n owns tokens cu[n]:cu[n+1]); state_indices [N] (the
    row's slot in conv_state_pool [slots, C, K-1]; negative = padding: zeros out, nothing
    touched); has_initial_state [N] bool (False: the row starts after zeros). Returns y
    [T, C] in x's dtype. A prefill chunk and a run of decode steps give the same bits.
    `token_parallel` (the default mode's mixed steps): on CUDA, programs over blocks of
    tokens instead of a loop over each row's tokens; the same values."""
    if use_triton(x):
        from kvloom.kernels.batch_invariant_triton import serial_causal_conv1d_triton

        return serial_causal_conv1d_triton(
            x, weight, bias, conv_state_pool, cu_seqlens, state_indices, has_initial_state,
            activation, token_parallel=token_parallel,
        )  # fmt: skip
    return serial_causal_conv1d_ref(
        x, weight, bias, conv_state_pool, cu_seqlens, state_indices, has_initial_state, activation
    )


def serial_gated_delta_rule(
    q, k, v, g, beta, state, cu_seqlens, state_indices, has_initial_state, *, scale=None,
    use_qk_l2norm=False, round_every_token=True,
):  # fmt: skip
    """The gated delta rule over packed rows, token by token, in place on the pool.

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; state [slots, Hv, Dk, Dv];
    cu_seqlens, state_indices, has_initial_state as `serial_causal_conv1d`. Returns out
    [T, Hv, Dv] in q's dtype. With `round_every_token` (the deterministic mode) the state
    is rounded to the pool's dtype after every token, so chunking a prompt changes no
    bits; without it a row's state stays float32 through its tokens and is rounded once,
    when stored (as the chunked kernels store it once a call: a narrow pool then loses
    less)."""
    return _serial_recurrence(
        False, round_every_token, q, k, v, g, beta, state, cu_seqlens, state_indices,
        has_initial_state, scale, use_qk_l2norm,
    )  # fmt: skip


def serial_kda(
    q, k, v, g, beta, state, cu_seqlens, state_indices, has_initial_state, *, scale=None,
    use_qk_l2norm=False, round_every_token=True,
):  # fmt: skip
    """Kimi Delta Attention over packed rows, token by token, in place on the pool: as
    `serial_gated_delta_rule` with one log-decay per key channel, g [T, Hv, Dk] (float32).
    A mixed step of many short rows may run this instead of the chunked kernels
    (workers/layers/kda_layer.py, KVLOOM_KDA_MIXED_STEPS)."""
    num_v_heads, head_k = v.shape[1], q.shape[2]
    if g.dim() != 3 or tuple(g.shape) != (q.shape[0], num_v_heads, head_k):
        raise ValueError(
            f"g: expected [{q.shape[0]}, {num_v_heads}, {head_k}], got {list(g.shape)}"
        )
    return _serial_recurrence(
        True, round_every_token, q, k, v, g.contiguous(), beta, state, cu_seqlens,
        state_indices, has_initial_state, scale, use_qk_l2norm,
    )  # fmt: skip


def _serial_recurrence(per_channel_decay, round_every_token, q, *args):
    """The serial Triton kernel on CUDA (for a float pool), else the matching reference."""
    state = args[4]
    if use_triton(q) and state.dtype in (torch.float16, torch.bfloat16, torch.float32):
        from kvloom.kernels.batch_invariant_triton import serial_gated_delta_rule_triton

        return serial_gated_delta_rule_triton(
            q, *args, per_channel_decay=per_channel_decay, round_every_token=round_every_token
        )
    reference = serial_kda_ref if per_channel_decay else serial_gated_delta_rule_ref
    return reference(q, *args, round_every_token=round_every_token)
