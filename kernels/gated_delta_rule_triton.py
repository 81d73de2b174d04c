"""Gated delta rule decode step (GDN and KDA): the fused Triton kernel.

Same semantics as `gated_delta_rule.recurrent_gated_delta_rule` (GDN, g [N, Hv]) and
`kda.recurrent_kda` (KDA, g [N, Hv, Dk]); read their docstrings for the math and layouts.
One launch does the whole step: no prepared (normalised, scaled, head-expanded) copies of
q and k, no gathered state, no scatter back.

Work split. A program owns one (row, value head, block of BV state columns). Every column
of the state S [Dk, Dv] evolves independently given k, q and that column's v and beta:

    S[:, j] <- decay * S[:, j]
    S[:, j] <- S[:, j] + k * beta * (v[j] - k . S[:, j])
    o[j]     = q . S[:, j]

so a program loads its [Dk, BV] tile once, keeps it in registers through the decay, the
prediction, the write and the read-out, and stores it back in place. It reloads the
row's q and k (Dk values each) and normalises them itself; that is cheaper than a
separate pass and keeps the whole step one kernel. Value head h reads key head
h // (Hv // Hk) by index (GQA without a materialised repeat). All arithmetic is float32;
the state is stored back in the pool's dtype and the output in q's.

Padding rows. A row whose slot index is negative writes zeros to its output and touches
nothing else: its slot, q, k, v, g and beta are never read (NaN there cannot leak). Slots
that no row names are never read either.

CUDA graphs. The entry points never synchronise with the device: they check shapes,
dtypes and devices only, and the grid depends on shapes only. Hence what they cannot
check: slot indices must be < num_slots and distinct among non-padding rows (the
reference checks both; here an out-of-range index is an out-of-bounds access and a
shared slot a race). Callers guarantee them.

BV depends only on (Dk, Dv), never on the batch, so a row's result is the same whatever
else is batched with it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.kernels.arg_checks_triton import (
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
    check_shape,
    next_power_of_2,
)
from kvloom.kernels.l2norm import L2NORM_EPS

# Register budget of one program's state tile (Dk padded x BV float32 values).
_TILE_ELEMENTS = 4096
_INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _delta_rule_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    slot_ptr,
    out_ptr,
    scale,
    eps,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_gn,
    stride_gh,
    stride_bn,
    stride_bh,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_on,
    stride_oh,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PER_CHANNEL_DECAY: tl.constexpr,
    L2NORM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    col_ok = cols < DV
    out_ptrs = out_ptr + row * stride_on + head * stride_oh + cols
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot < 0:
        tl.store(out_ptrs, tl.zeros([BV], dtype=out_ptr.dtype.element_ty), mask=col_ok)
    else:
        dims = tl.arange(0, BK)
        dim_ok = dims < DK
        key_head = head // GROUP
        q = tl.load(q_ptr + row * stride_qn + key_head * stride_qh + dims, mask=dim_ok, other=0.0)
        k = tl.load(k_ptr + row * stride_kn + key_head * stride_kh + dims, mask=dim_ok, other=0.0)
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        if L2NORM:
            # Same form as kernels/l2norm.py: divide by sqrt(sum of squares + eps).
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps)
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
        q = q * scale

        tile_ok = dim_ok[:, None] & col_ok[None, :]
        s_ptrs = state_ptr + slot * stride_ss + head * stride_sh
        s_ptrs = s_ptrs + dims[:, None] * stride_sk + cols[None, :]
        s = tl.load(s_ptrs, mask=tile_ok, other=0.0).to(tl.float32)

        gate = g_ptr + row * stride_gn + head * stride_gh
        if PER_CHANNEL_DECAY:
            decay = tl.exp(tl.load(gate + dims, mask=dim_ok, other=0.0).to(tl.float32))
            s = s * decay[:, None]
        else:
            s = s * tl.exp(tl.load(gate).to(tl.float32))

        v = tl.load(v_ptr + row * stride_vn + head * stride_vh + cols, mask=col_ok, other=0.0)
        beta = tl.load(beta_ptr + row * stride_bn + head * stride_bh).to(tl.float32)
        predicted = tl.sum(k[:, None] * s, axis=0)
        write = beta * (v.to(tl.float32) - predicted)
        s = s + k[:, None] * write[None, :]
        out = tl.sum(q[:, None] * s, axis=0)

        tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=tile_ok)
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=col_ok)


def _block_v(head_k: int, head_v: int) -> int:
    """State columns per program: as many as fit the tile budget, from the head dims only."""
    return max(1, min(next_power_of_2(head_v), _TILE_ELEMENTS // next_power_of_2(head_k)))


def _check_args(q, k, v, g, beta, state, state_indices, per_channel_decay, scale):
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        check_dtype(name, t)
    if not isinstance(state_indices, torch.Tensor):
        raise ValueError(
            f"state_indices: expected a torch.Tensor, got {type(state_indices).__name__}"
        )
    if q.dim() != 3:
        raise ValueError(f"q: expected [N, Hk, Dk], got shape {tuple(q.shape)}")
    num_rows, num_k_heads, head_k = q.shape
    check_shape("k", k, tuple(q.shape))
    if v.dim() != 3 or v.shape[0] != num_rows:
        raise ValueError(f"v: expected [{num_rows}, Hv, Dv], got shape {tuple(v.shape)}")
    num_v_heads, head_v = v.shape[1], v.shape[2]
    if num_k_heads == 0 or num_v_heads % num_k_heads:
        raise ValueError(
            f"v: value heads ({num_v_heads}) must be a multiple of key heads ({num_k_heads})"
        )
    if per_channel_decay:
        check_shape("g", g, (num_rows, num_v_heads, head_k))
    else:
        check_shape("g", g, (num_rows, num_v_heads))
    check_shape("beta", beta, (num_rows, num_v_heads))
    if state.dim() != 4 or tuple(state.shape[1:]) != (num_v_heads, head_k, head_v):
        raise ValueError(
            f"state: expected [num_slots, {num_v_heads}, {head_k}, {head_v}], "
            f"got shape {tuple(state.shape)}"
        )
    check_shape("state_indices", state_indices, (num_rows,))
    if state_indices.dtype not in _INDEX_DTYPES:
        raise ValueError(f"state_indices: expected int32 or int64, got {state_indices.dtype}")
    if num_rows > 1 and state_indices.stride(0) != 1:
        raise ValueError("state_indices: must be contiguous")
    for name, t in (("q", q), ("k", k), ("v", v), ("state", state)):
        check_last_dim_contiguous(name, t)
    if per_channel_decay:
        check_last_dim_contiguous("g", g)
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, state=state, state_indices=state_indices)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ValueError(f"scale: expected a float or None, got {scale!r}")


def _decode_step(
    q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm, per_channel, block_v
):
    _check_args(q, k, v, g, beta, state, state_indices, per_channel, scale)
    num_rows, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1], v.shape[2]
    out = torch.empty((num_rows, num_v_heads, head_v), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    block_v = block_v or _block_v(head_k, head_v)
    grid = (num_rows, num_v_heads, triton.cdiv(head_v, block_v))
    _delta_rule_decode_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        state,
        state_indices,
        out,
        float(head_k**-0.5 if scale is None else scale),
        L2NORM_EPS,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        beta.stride(1),
        state.stride(0),
        state.stride(1),
        state.stride(2),
        out.stride(0),
        out.stride(1),
        GROUP=num_v_heads // num_k_heads,
        DK=head_k,
        DV=head_v,
        BK=next_power_of_2(head_k),
        BV=block_v,
        PER_CHANNEL_DECAY=per_channel,
        L2NORM=bool(use_qk_l2norm),
        num_warps=4,
    )
    return out


def recurrent_gated_delta_rule_triton(
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
    _block_v_override: int | None = None,
) -> torch.Tensor:
    """One Gated DeltaNet decode step per row (see `recurrent_gated_delta_rule`).

    q, k [N, Hk, Dk]; v [N, Hv, Dv]; g (log-decay), beta [N, Hv]; `state` is the pool
    [num_slots, Hv, Dk, Dv] (float32, or a half type), updated in place at state_indices
    [N] (int32/int64; negative = padding row: output zeros, nothing read or written).
    Inputs may be strided views whose last dim is contiguous. Returns out [N, Hv, Dv] in
    q's dtype. No host sync; the caller guarantees indices in range and distinct.
    `_block_v_override` (a power of two) overrides the state columns per program, for tests.
    """
    return _decode_step(
        q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm, False, _block_v_override
    )


def recurrent_kda_triton(
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
    _block_v_override: int | None = None,
) -> torch.Tensor:
    """One KDA decode step per row (see `kda.recurrent_kda`): as
    `recurrent_gated_delta_rule_triton` with a per-key-channel log-decay g [N, Hv, Dk]."""
    return _decode_step(
        q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm, True, _block_v_override
    )
