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
else is batched with it. The tile budget holds a whole 128 x 128 head in one program (16
warps), for Gated DeltaNet and KDA alike.

Fused decode step (`gdn_decode_triton`, the layer's decode-only steps). The kernel can
also compute g and beta itself from the in_proj output's b and a columns (`gdn_gate_values`,
the gates kernel's formula), and, where a program holds a whole value head, apply the
gated RMSNorm to its output before the store (`gated_rms_norm_rows`, the norm kernel's):
one launch in place of three, with the same bits as the three. KDA's decode step
(`kda_decode_triton`) likewise computes its per-channel g and beta from the f_b output
and beta's logits (`kda_gate_values`) and applies its sigmoid-gated norm
(`kda_gated_norm_rows`). For that, the launches, fused or not, compile without fused
multiply-adds as the gates and norm kernels do (the compiler would contract their
formulas differently inside a bigger kernel), and the norm's sum of squares is order-free
(`sum_of_squares`). Compiled offline for sm_90 (Triton 3.6 and 3.9), Gated DeltaNet's
plain, gates-fused and fully fused variants reduce the state tile in the same layout,
with no register spills (KDA's variants are not yet checked so).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.contracts import envs
from kvloom.kernels.arg_checks_triton import (
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
    check_shape,
    next_power_of_2,
)
from kvloom.kernels.arrival_counters import arrival_counters
from kvloom.kernels.gated_rms_norm import check_gated_rms_norm_args
from kvloom.kernels.gated_rms_norm_triton import gated_rms_norm_rows, gated_rms_norm_triton
from kvloom.kernels.gdn_gates import check_gdn_gates_args
from kvloom.kernels.gdn_gates_triton import gdn_gate_values
from kvloom.kernels.kda_gated_norm import check_kda_gated_norm_args
from kvloom.kernels.kda_gated_norm_triton import kda_gated_norm_rows, kda_gated_norm_triton
from kvloom.kernels.kda_gates import check_kda_gates_args
from kvloom.kernels.kda_gates_triton import kda_gate_values
from kvloom.kernels.l2norm import L2NORM_EPS

# Register budget of one program's state tile (Dk padded x BV float32 values): 4096, block_v
# 32 at 128 x 128 heads, the output norm a separate launch. On an H100 that beat a whole
# head per program (one launch with the norm) at every batch, for Gated DeltaNet (10.1 vs
# 13.1 us per layer step at 1 row, 235 vs 319 at 128) and for KDA (9.9 vs 13.8 us at 1
# row; benchmarks/gdn_decode_fusion.py and kda_decode_fusion.py, gpu_fast_path.md's twelfth
# and thirteenth sessions). Heads up to 64 x 64 still fit one program and fuse the norm.
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
    ba_ptr,
    a_log_ptr,
    dt_bias_ptr,
    z_ptr,
    norm_w_ptr,
    scale,
    eps,
    norm_eps,
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
    stride_ban,
    stride_zn,
    stride_zk,
    stride_zj,
    counter_ptr,
    stride_cn,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PER_CHANNEL_DECAY: tl.constexpr,
    L2NORM: tl.constexpr,
    GATES_FROM_BA: tl.constexpr,
    BA_GROUP: tl.constexpr,
    NORM: tl.constexpr,
    Z_GROUP: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,
    KDA_GATES: tl.constexpr = False,
    NORM_SIGMOID: tl.constexpr = False,
    NORM_TAIL: tl.constexpr = False,
    DV_PAD: tl.constexpr = 1,
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

        if GATES_FROM_BA:
            # What gdn_gates_triton writes and this kernel would read back: g in float32,
            # beta rounded to ba's dtype. Head h reads b at (h // r) * 2r + h % r, a r later.
            b_col = (head // BA_GROUP) * (2 * BA_GROUP) + head % BA_GROUP
            b_ptr = ba_ptr + row * stride_ban + b_col
            b = tl.load(b_ptr).to(tl.float32)
            a = tl.load(b_ptr + BA_GROUP).to(tl.float32)
            a_log = tl.load(a_log_ptr + head).to(tl.float32)
            dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
            log_decay, beta = gdn_gate_values(b, a, a_log, dt_bias)
            s = s * tl.exp(log_decay)
            beta = beta.to(ba_ptr.dtype.element_ty).to(tl.float32)
        elif KDA_GATES:
            # What kda_gates_triton writes and this kernel would read back: g from the
            # f_b output (g_ptr) per channel in float32, beta from its logits (beta_ptr)
            # rounded to their dtype.
            raw = tl.load(g_ptr + row * stride_gn + head * stride_gh + dims, mask=dim_ok, other=0.0)
            dt_bias = tl.load(dt_bias_ptr + head * DK + dims, mask=dim_ok, other=0.0)
            a_log = tl.load(a_log_ptr + head).to(tl.float32)
            logits = tl.load(beta_ptr + row * stride_bn + head * stride_bh).to(tl.float32)
            log_decay, beta = kda_gate_values(
                raw.to(tl.float32), dt_bias.to(tl.float32), a_log, logits
            )
            s = s * tl.exp(log_decay)[:, None]
            beta = beta.to(beta_ptr.dtype.element_ty).to(tl.float32)
        else:
            gate = g_ptr + row * stride_gn + head * stride_gh
            if PER_CHANNEL_DECAY:
                decay = tl.exp(tl.load(gate + dims, mask=dim_ok, other=0.0).to(tl.float32))
                s = s * decay[:, None]
            else:
                s = s * tl.exp(tl.load(gate).to(tl.float32))
            beta = tl.load(beta_ptr + row * stride_bn + head * stride_bh).to(tl.float32)

        v = tl.load(v_ptr + row * stride_vn + head * stride_vh + cols, mask=col_ok, other=0.0)
        predicted = tl.sum(k[:, None] * s, axis=0)
        write = beta * (v.to(tl.float32) - predicted)
        s = s + k[:, None] * write[None, :]
        out = tl.sum(q[:, None] * s, axis=0)

        tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=tile_ok)
        z_offs = row * stride_zn + (head // Z_GROUP) * stride_zk + (head % Z_GROUP) * stride_zj
        if NORM:
            # The program holds the whole value head (BV >= DV): the gated RMSNorm the
            # separate launch would apply to this output, read back in its dtype.
            x = out.to(out_ptr.dtype.element_ty)[None, :]
            out = tl.reshape(
                _output_norm(x, z_ptr + z_offs, norm_w_ptr, cols, col_ok, norm_eps, DV,
                             ROUND_PRODUCT, NORM_SIGMOID),
                [BV],
            )  # fmt: skip
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=col_ok)
        if NORM_TAIL:
            # The head's output is split over programs (BV < DV): each arrives at the
            # (row, head) counter after its store; the last to arrive reads the whole head
            # back as stored and applies the norm as the NORM path does, then sets the
            # counter back to 0. The barrier orders every thread's stores before the
            # release; the acquire orders the other programs' stores before the loads.
            tl.debug_barrier()
            count_ptr = counter_ptr + row * stride_cn + head
            arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
            if arrived == tl.num_programs(2) - 1:
                head_cols = tl.arange(0, DV_PAD)
                head_ok = head_cols < DV
                head_out = out_ptr + row * stride_on + head * stride_oh + head_cols
                x = tl.load(head_out, mask=head_ok, other=0.0)[None, :]
                normed = _output_norm(
                    x, z_ptr + z_offs, norm_w_ptr, head_cols, head_ok, norm_eps, DV,
                    ROUND_PRODUCT, NORM_SIGMOID,
                )  # fmt: skip
                tl.store(
                    head_out,
                    tl.reshape(normed, [DV_PAD]).to(out_ptr.dtype.element_ty),
                    mask=head_ok,
                )
                tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _output_norm(x, z_row_ptr, norm_w_ptr, cols, col_ok, norm_eps, DV: tl.constexpr,
                 ROUND_PRODUCT: tl.constexpr, NORM_SIGMOID: tl.constexpr):  # fmt: skip
    """The layer's output norm on x [1, C] (the output in its dtype) over columns `cols` of
    one value head: Gated DeltaNet's gated RMSNorm (gated_rms_norm_triton's formula) or
    KDA's sigmoid-gated one (kda_gated_norm_triton's) -> float32 [1, C]."""
    z = tl.load(z_row_ptr + cols, mask=col_ok, other=0.0)[None, :]
    w = tl.load(norm_w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if NORM_SIGMOID:
        return kda_gated_norm_rows(x.to(tl.float32), z.to(tl.float32), w, norm_eps, DV)
    return gated_rms_norm_rows(x, z, w, norm_eps, DV, ROUND_PRODUCT)


def _block_v(head_k: int, head_v: int, tile_elements: int = _TILE_ELEMENTS) -> int:
    """State columns per program: as many as fit the tile budget, from the head dims only."""
    return max(1, min(next_power_of_2(head_v), tile_elements // next_power_of_2(head_k)))


def _num_warps(head_k: int, block_v: int) -> int:
    """Four warps up to 4096 tile elements, then one more warp per 1024 (32 per thread)."""
    return max(4, next_power_of_2(head_k) * block_v // 1024)


def fuses_norm(head_k: int, head_v: int) -> bool:
    """Whether `gdn_decode_triton` and `kda_decode_triton` apply the output norm in the same
    launch: one program holds a whole value head."""
    return _block_v(head_k, head_v) >= head_v


def _check_args(
    q, k, v, g, beta, state, state_indices, per_channel_decay, scale, computes_gates=False
):
    """`computes_gates`: the fused step, which takes no g and beta (`_check_fusion`)."""
    gates = () if computes_gates else (("g", g), ("beta", beta))
    for name, t in (("q", q), ("k", k), ("v", v), *gates, ("state", state)):
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
    if gates:
        g_shape = (num_rows, num_v_heads, head_k) if per_channel_decay else (num_rows, num_v_heads)
        check_shape("g", g, g_shape)
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
    if per_channel_decay and gates:
        check_last_dim_contiguous("g", g)
    check_same_device(q=q, k=k, v=v, **dict(gates), state=state, state_indices=state_indices)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ValueError(f"scale: expected a float or None, got {scale!r}")


def _check_fusion(v, ba, A_log, dt_bias, ba_group, z, norm_weight, norm_eps) -> None:
    """The fused step's extra inputs: the gates' (as gdn_gates_triton takes them) and the
    norm's (as gated_rms_norm_triton, with v standing in for its x of the same shape)."""
    num_rows, num_v_heads = v.shape[0], v.shape[1]
    tokens, _, gate_heads = check_gdn_gates_args(ba, A_log, dt_bias, ba_group)
    if (tokens, gate_heads) != (num_rows, num_v_heads):
        raise ValueError(
            f"ba: expected {num_rows} rows for {num_v_heads} value heads, got shape "
            f"{list(ba.shape)} (group {ba_group})"
        )
    check_gated_rms_norm_args(v, z, norm_weight, norm_eps)
    named = (("ba", ba), ("A_log", A_log), ("dt_bias", dt_bias), ("z", z), ("weight", norm_weight))
    for name, t in named:
        check_dtype(name, t)
        check_last_dim_contiguous(name, t)
    check_same_device(v=v, ba=ba, A_log=A_log, dt_bias=dt_bias, z=z, weight=norm_weight)


def _decode_step(
    q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm, per_channel, block_v
):
    _check_args(q, k, v, g, beta, state, state_indices, per_channel, scale)
    block_v = block_v or _block_v(q.shape[2], v.shape[2])
    return _launch(
        q, k, v, state, state_indices, scale, use_qk_l2norm, block_v, per_channel, g, beta
    )


NORM_TAIL_MIN_ROWS = 512


def norm_tail_counters(device: torch.device, rows: int, heads: int) -> torch.Tensor:
    """The norm tail's arrival counters [rows, heads], one per (row, value head)."""
    return arrival_counters("linear_norm_tail", device, rows, heads, NORM_TAIL_MIN_ROWS)


# The norm tail saves a launch but makes a head's last program re-read its row and
# normalise it alone: on an H100 (twenty-seventh session, Qwen3-Next's heads, bitwise) it
# took one row from 10.1 to 9.0 us but 128 rows from 235 to 248 us and 512 rows 8% slower,
# so larger steps keep the separate norm launch (the same bits).
NORM_TAIL_MAX_ROWS = 8


def uses_norm_tail(num_rows: int) -> bool:
    """Whether a decode step of `num_rows` rows whose value heads span several programs
    applies the output norm in its launch (NORM_TAIL), not in a norm launch after it: at
    most NORM_TAIL_MAX_ROWS rows, unless KVLOOM_UNFUSED names linear_norm_tail (on an H100
    it took Qwen3-Next-16l's batch-1 decode from 1.659 to 1.648 ms/token)."""
    return num_rows <= NORM_TAIL_MAX_ROWS and not envs.unfused("linear_norm_tail")


def _norm_tail(forced: bool | None, q: torch.Tensor) -> bool:
    """`norm_tail` of the fused decode steps: forced on or off, or `uses_norm_tail`."""
    return uses_norm_tail(q.shape[0]) if forced is None else forced


def _launch(
    q, k, v, state, state_indices, scale, use_qk_l2norm, block_v, per_channel,
    g=None, beta=None, gates=None, norm=None,
):  # fmt: skip
    """One launch of the decode kernel on checked arguments. Either g, beta [N, Hv] (KDA's
    g [N, Hv, Dk]) or gates = (ba, A_log, dt_bias, r): computed in the kernel. norm = (z,
    weight, eps): the gated RMSNorm at the store, by the one program of each head (block_v
    >= Dv) or by the last of its programs to store (the norm tail). Gated DeltaNet's launches
    compile without fused multiply-adds, as the gates and norm kernels do, so the fused
    and separate launches give the same bits; so do KDA's (kda_decode_triton)."""
    num_rows, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1], v.shape[2]
    out = torch.empty((num_rows, num_v_heads, head_v), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    if gates is None:
        ba, a_log, dt_bias, ba_group = g, g, g, 1  # not read
        gate_strides = (g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), 0)
    elif per_channel:  # KDA: g and beta from (f_b output, A_log, dt_bias, beta's logits)
        g, a_log, dt_bias, beta = gates
        ba, ba_group = g, 1  # not read
        gate_strides = (g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), 0)
    else:
        ba, a_log, dt_bias, ba_group = gates
        g = beta = ba  # not read
        gate_strides = (0, 0, 0, 0, ba.stride(0))
    z, norm_weight, norm_eps, z_group, round_product = out, out, 0.0, 1, False
    z_strides = (0, 0, 0)
    if norm is not None:
        z, norm_weight, norm_eps = norm
        z_strides = (z.stride(0), z.stride(1), z.stride(2) if z.dim() == 4 else 0)
        z_group = z.shape[2] if z.dim() == 4 else 1
        # As gated_rms_norm_triton: the weight product is rounded where torch promotes the
        # (weight, x) pair to a half type.
        half = (torch.float16, torch.bfloat16)
        round_product = torch.promote_types(norm_weight.dtype, q.dtype) in half
    grid = (num_rows, num_v_heads, triton.cdiv(head_v, block_v))
    tail = norm is not None and block_v < head_v
    counters = norm_tail_counters(q.device, num_rows, num_v_heads) if tail else out
    _delta_rule_decode_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        state,
        state_indices,
        out,
        ba,
        a_log,
        dt_bias,
        z,
        norm_weight,
        float(head_k**-0.5 if scale is None else scale),
        L2NORM_EPS,
        float(norm_eps),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *gate_strides[:4],
        state.stride(0),
        state.stride(1),
        state.stride(2),
        out.stride(0),
        out.stride(1),
        gate_strides[4],
        *z_strides,
        counters,
        counters.stride(0),
        GROUP=num_v_heads // num_k_heads,
        DK=head_k,
        DV=head_v,
        BK=next_power_of_2(head_k),
        BV=block_v,
        PER_CHANNEL_DECAY=per_channel,
        L2NORM=bool(use_qk_l2norm),
        GATES_FROM_BA=gates is not None and not per_channel,
        BA_GROUP=ba_group,
        NORM=norm is not None and not tail,
        Z_GROUP=z_group,
        ROUND_PRODUCT=round_product,
        KDA_GATES=gates is not None and per_channel,
        NORM_SIGMOID=norm is not None and per_channel,
        NORM_TAIL=tail,
        DV_PAD=next_power_of_2(head_v),
        num_warps=_num_warps(head_k, block_v),
        enable_fp_fusion=False,  # as the gates and norm kernels: fused = separate bits
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


def gdn_decode_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ba: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ba_group: int,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    norm_tail: bool | None = None,
    _block_v_override: int | None = None,
) -> torch.Tensor:
    """A Gated DeltaNet decode step after the conv: gates, recurrence and gated RMSNorm,
    bit for bit `gdn_gates_triton(ba, A_log, dt_bias, ba_group)`, then
    `recurrent_gated_delta_rule_triton` with those g and beta, then
    `gated_rms_norm_triton(out, z, norm_weight, norm_eps)`, in one launch where a program
    holds a whole value head (`fuses_norm`: heads up to 64 x 64); else (Qwen3-Next's
    128 x 128 heads, where the narrow tiles are faster) in one launch with the norm applied
    by each head's last program (the norm tail: `norm_tail`, or `uses_norm_tail` when None)
    or in two (the norm separate). Padding rows (negative index) give zeros in one launch
    (the separate norm gives 0 * silu(z): -0.0 for z < 0, NaN for a NaN z); their q, k, v,
    ba and z are never read there.

    ba [N, Hk' * 2r] (b then a per group of r = ba_group value heads, rows strided), A_log
    and dt_bias [Hv], z [N, Hv, Dv] or [N, Hk', r', Dv] (strided), norm_weight [Dv]; the
    rest as `recurrent_gated_delta_rule_triton`. No host sync: CUDA-graph capturable."""
    _check_args(q, k, v, None, None, state, state_indices, False, scale, computes_gates=True)
    _check_fusion(v, ba, A_log, dt_bias, ba_group, z, norm_weight, norm_eps)
    head_k, head_v = q.shape[2], v.shape[2]
    block_v = _block_v_override or _block_v(head_k, head_v)
    gates = (ba, A_log, dt_bias, ba_group)
    args = (q, k, v, state, state_indices, scale, use_qk_l2norm, block_v, False)
    if block_v >= head_v or _norm_tail(norm_tail, q):
        return _launch(*args, gates=gates, norm=(z, norm_weight, norm_eps))
    return gated_rms_norm_triton(_launch(*args, gates=gates), z, norm_weight, norm_eps)


def _check_kda_fusion(q, v, raw_gate, A_log, dt_bias, beta_logits, gate, norm_weight, norm_eps):
    """The fused KDA step's extra inputs: the gates' (as kda_gates_triton takes them) and
    the norm's (as kda_gated_norm_triton, with v standing in for its x of the same shape)."""
    num_rows, num_v_heads, head_k = v.shape[0], v.shape[1], q.shape[2]
    shape = check_kda_gates_args(raw_gate, A_log, dt_bias, beta_logits)
    if tuple(shape) != (num_rows, num_v_heads, head_k):
        raise ValueError(
            f"raw_gate: expected [{num_rows}, {num_v_heads}, {head_k}], "
            f"got shape {list(raw_gate.shape)}"
        )
    check_kda_gated_norm_args(v, gate, norm_weight, norm_eps)
    named = (("raw_gate", raw_gate), ("A_log", A_log), ("dt_bias", dt_bias))
    named += (("beta_logits", beta_logits), ("gate", gate), ("weight", norm_weight))
    for name, t in named:
        check_dtype(name, t)
        check_last_dim_contiguous(name, t)
    check_same_device(v=v, **dict(named))


def kda_decode_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_gate: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    beta_logits: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    gate: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    norm_tail: bool | None = None,
    _block_v_override: int | None = None,
) -> torch.Tensor:
    """A KDA decode step after the conv: gates, recurrence and output norm, bit for bit
    `kda_gates_triton(raw_gate, A_log, dt_bias, beta_logits)`, then `recurrent_kda_triton`
    with those g and beta, then `kda_gated_norm_triton(out, gate, norm_weight, norm_eps)`,
    in one launch where a program holds a whole value head (`fuses_norm`: heads up to
    64 x 64); else (Kimi-Linear's 128 x 128 heads, where the narrow tiles are faster) in
    one launch with the norm tail (`norm_tail`, or `uses_norm_tail` when None) or in two
    (the norm separate). Padding rows (negative index) give zeros in one launch (the
    separate norm gives w * 0 * sigmoid(gate): -0.0 where w < 0, NaN for a NaN gate);
    their inputs are never read there.

    raw_gate [N, Hv, Dk] (f_b_proj's output), A_log [Hv], dt_bias [Hv * Dk], beta_logits
    [N, Hv], gate [N, Hv, Dv] (g_b_proj's output), norm_weight [Dv], all strided with the
    last dim contiguous; the rest as `recurrent_kda_triton`. No host sync."""
    _check_args(q, k, v, None, None, state, state_indices, True, scale, computes_gates=True)
    _check_kda_fusion(q, v, raw_gate, A_log, dt_bias, beta_logits, gate, norm_weight, norm_eps)
    head_k, head_v = q.shape[2], v.shape[2]
    block_v = _block_v_override or _block_v(head_k, head_v)
    gates = (raw_gate, A_log, dt_bias, beta_logits)
    args = (q, k, v, state, state_indices, scale, use_qk_l2norm, block_v, True)
    if block_v >= head_v or _norm_tail(norm_tail, q):
        return _launch(*args, gates=gates, norm=(gate, norm_weight, norm_eps))
    return kda_gated_norm_triton(_launch(*args, gates=gates), gate, norm_weight, norm_eps)
