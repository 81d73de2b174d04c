"""Per-head q/k RMSNorm + rotary embedding in one launch: the Triton kernel.

Same semantics as `qk_norm_rope.qk_norm_rope_ref` (rms_norm_ref per head, then
apply_rotary_ref with `cos_table[positions]`). Without it a decode step pays, per attention
layer, two RMSNorm launches, two index kernels gathering cos/sin and two rotary launches;
here one launch reads each head row once, gathers the position's cos/sin itself and writes
the finished row.

Grid: one program per (token, head) over the Hq query heads followed by the Hk key heads,
so q and k share the launch; the program branches once on which tensor its head is in.
Per-head programs keep decode (T = 1) spread over ~Hq + Hk SMs instead of a few. At
prefill sizes a program takes several tokens of its head (`tokens_per_program`), each by
the same per-row code: the same bits, far fewer programs.

Rounding follows the two references step by step: the norm runs in float32 and is rounded
to the activation dtype before the weight multiplies (weight_offset = 0), or multiplies by
the float32 (offset + w) and is rounded after (weight_offset != 0); cos/sin are rounded to
the activation dtype, each rotary product and the final sum are rounded, and the kernel is
compiled without fused multiply-adds. Only the mean of squares and the reciprocal square
root may differ from torch in the last float32 bits, so half results match to ~1 ulp of
the normalised value and float32 to ~1e-6.

With a cache write (`qk_norm_rope_kv_write_triton`) the key-head programs also store the
finished key row and the token's value row into the paged cache at slot_mapping, as
`kv_cache_write_triton` would in a second launch: the same `to_cache` conversion of the
same rounded key, so the cache contents are bitwise those of the two launches. Slots
below 0 (padding tokens, and under DCP the positions another rank caches) write nothing.

No host synchronisation: positions and slots are read on the device, so the launch is
CUDA-graph capturable. Positions must lie in [0, max_pos); that is not checked (it would
need a sync).
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
from kvloom.kernels.kv_cache_write_triton import check_kv_write_args, to_cache
from kvloom.kernels.pdl_triton import pdl_launch, pdl_release_then_wait, uses_pdl

MAX_HEAD_DIM = 8192  # one program holds a whole head row in registers
MAX_HEADS = 65535  # the grid's second dimension
POSITION_DTYPES = (torch.int32, torch.int64)

# Tokens per program (the kernel's TOKENS): TOKENS_PER_PROGRAM from MANY_TOKENS tokens
# up, 2 from 128, else 1. Same bits at each. Timed in graphs on an H100, Qwen3-8B heads
# (benchmarks/qk_norm_rope_plans.py; data/qk_norm_rope_plans_h100_2026-12-06s19.json),
# us at 1 / 2 / 4 tokens a program: 64 tokens 3.35 / 3.49 / 4.73; 128: 4.89 / 3.73 / 4.89;
# 512: 14.2 / 8.5 / 7.3; 16,384: 396.5 / 227.8 / 186.4 (8: 186.1).
MANY_TOKENS = 512
TOKENS_PER_PROGRAM = 4


def tokens_per_program(num_tokens: int) -> int:
    """One token a program at decode sizes (spread over the SMs), more at prefill sizes:
    the plan by size, never a different result (invariant 7)."""
    if num_tokens >= MANY_TOKENS:
        return TOKENS_PER_PROGRAM
    return 2 if num_tokens >= 128 else 1


@triton.jit
def _normalize(x, w_ptrs, mask, rstd, weight_offset, DTYPE: tl.constexpr, HAS_OFFSET: tl.constexpr):
    """rms_norm_ref's output for one piece of a row, as float32 holding DTYPE values."""
    h = x * rstd
    w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_OFFSET:
        out = h * (weight_offset + w)
    else:
        out = w * h.to(DTYPE).to(tl.float32)
    return out.to(DTYPE).to(tl.float32)


@triton.jit(do_not_specialize=["num_tokens"])  # T changes every step: no recompiles
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_pos,
    stride_cos,
    stride_sin,
    eps,
    weight_offset,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_vt,
    stride_vh,
    stride_ckv,
    stride_cb,
    stride_co,
    stride_ch,
    stride_slot,
    block_size,
    k_inv_scale,
    v_inv_scale,
    num_tokens,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    QUANT: tl.constexpr,
    DIM_PAD: tl.constexpr,
    TOKENS: tl.constexpr = 1,
    GDC: tl.constexpr = 0,
):
    pdl_release_then_wait(GDC)  # kernels/pdl_triton.py
    # Program (b, h): head h of tokens b * TOKENS ... b * TOKENS + TOKENS - 1, each by the
    # same per-row code (so the same bits at any TOKENS): many tokens a program at
    # prefill sizes, where one-token programs are too short to keep loads in flight; one
    # at decode sizes, spread over the SMs.
    first = tl.program_id(0).to(tl.int64) * TOKENS
    for i in tl.static_range(TOKENS):
        # Past the last token a program redoes the last one: the same values to the same
        # places, so no store needs a mask and the unrolled tokens' loads can overlap.
        token = tl.minimum(first + i, num_tokens - 1)
        head = tl.program_id(1)
        if head < NUM_Q_HEADS:
            src = q_ptr + token * stride_qt + head * stride_qh
            dst = q_out_ptr + (token * NUM_Q_HEADS + head) * HEAD_DIM
            w_ptr = q_weight_ptr
        else:
            k_head = head - NUM_Q_HEADS
            src = k_ptr + token * stride_kt + k_head * stride_kh
            dst = k_out_ptr + (token * NUM_K_HEADS + k_head) * HEAD_DIM
            w_ptr = k_weight_ptr
        dtype = q_out_ptr.dtype.element_ty

        # The row in three pieces: the two rotary halves and the pass-through tail.
        dims = tl.arange(0, HALF_PAD)
        half_mask = dims < HALF
        x1 = tl.load(src + dims, mask=half_mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + dims, mask=half_mask, other=0.0).to(tl.float32)
        if PASS_PAD > 0:
            rest = tl.arange(0, PASS_PAD)
            rest_mask = rest < HEAD_DIM - 2 * HALF
            xr = tl.load(src + 2 * HALF + rest, mask=rest_mask, other=0.0).to(tl.float32)

        if HAS_WEIGHT:
            sum_sq = tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)
            if PASS_PAD > 0:
                sum_sq += tl.sum(xr * xr, axis=0)
            rstd = tl.rsqrt(sum_sq / HEAD_DIM + eps)
            x1 = _normalize(x1, w_ptr + dims, half_mask, rstd, weight_offset, dtype, HAS_OFFSET)
            x2 = _normalize(
                x2, w_ptr + HALF + dims, half_mask, rstd, weight_offset, dtype, HAS_OFFSET
            )
            if PASS_PAD > 0:
                w_rest = w_ptr + 2 * HALF + rest
                xr = _normalize(xr, w_rest, rest_mask, rstd, weight_offset, dtype, HAS_OFFSET)

        # Gather this token's cos/sin and round them to the activation dtype, as the reference.
        pos = tl.load(pos_ptr + token * stride_pos).to(tl.int64)
        cos = tl.load(cos_ptr + pos * stride_cos + dims, mask=half_mask, other=0.0)
        sin = tl.load(sin_ptr + pos * stride_sin + dims, mask=half_mask, other=0.0)
        cos = cos.to(dtype).to(tl.float32)
        sin = sin.to(dtype).to(tl.float32)
        x1c = (x1 * cos).to(dtype).to(tl.float32)
        x2s = (x2 * sin).to(dtype).to(tl.float32)
        x2c = (x2 * cos).to(dtype).to(tl.float32)
        x1s = (x1 * sin).to(dtype).to(tl.float32)
        out1 = (x1c - x2s).to(dtype)
        out2 = (x2c + x1s).to(dtype)
        tl.store(dst + dims, out1, mask=half_mask)
        tl.store(dst + HALF + dims, out2, mask=half_mask)
        if PASS_PAD > 0:
            tl.store(dst + 2 * HALF + rest, xr.to(dtype), mask=rest_mask)

        if WRITE_CACHE:  # a constexpr branch: nothing of it is compiled without a cache write
            k_head = head - NUM_Q_HEADS
            if k_head >= 0:
                _store_key_value(
                    out1,
                    out2,
                    xr if PASS_PAD > 0 else out1,  # out1 stands in when there is no tail
                    v_ptr + token * stride_vt + k_head * stride_vh,
                    cache_ptr + k_head * stride_ch,
                    tl.load(slot_ptr + token * stride_slot).to(tl.int64),
                    stride_ckv,
                    stride_cb,
                    stride_co,
                    block_size,
                    k_inv_scale,
                    v_inv_scale,
                    QUANT,
                    HEAD_DIM,
                    HALF,
                    HALF_PAD,
                    PASS_PAD,
                    DIM_PAD,
                )


@triton.jit
def _store_key_value(
    key1,
    key2,
    key_tail,
    v_src,
    cache_head,
    slot,
    stride_ckv,
    stride_cb,
    stride_co,
    block_size,
    k_inv_scale,
    v_inv_scale,
    QUANT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    """One key head's finished row (its rotary halves key1/key2 in the activation dtype and
    its float32 pass-through tail) and the token's value row v_src, stored at `slot` as
    kv_cache_write_triton stores them; slot < 0 (padding, another DCP rank's position)
    stores nothing."""
    if slot >= 0:
        dst = cache_head + (slot // block_size) * stride_cb + (slot % block_size) * stride_co
        dtype = cache_head.dtype.element_ty
        dims = tl.arange(0, HALF_PAD)
        half_mask = dims < HALF
        tl.store(dst + dims, to_cache(key1, k_inv_scale, dtype, QUANT), mask=half_mask)
        tl.store(dst + HALF + dims, to_cache(key2, k_inv_scale, dtype, QUANT), mask=half_mask)
        if PASS_PAD > 0:
            rest = tl.arange(0, PASS_PAD)
            tail = to_cache(key_tail.to(key1.dtype), k_inv_scale, dtype, QUANT)
            tl.store(dst + 2 * HALF + rest, tail, mask=rest < HEAD_DIM - 2 * HALF)
        all_dims = tl.arange(0, DIM_PAD)
        dim_mask = all_dims < HEAD_DIM
        value = to_cache(tl.load(v_src + all_dims, mask=dim_mask), v_inv_scale, dtype, QUANT)
        tl.store(dst + stride_ckv + all_dims, value, mask=dim_mask)


def qk_norm_rope_triton(
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

    q and k may be strided views (last dim contiguous), e.g. head views of slices of a fused
    qkv projection. Weights are both given ([D], the activation dtype) or both None (rotary
    only). Returns new contiguous (q_out, k_out).
    """
    args = (q, k, positions, cos_table, sin_table, q_weight, k_weight, eps, rotary_dim)
    return _launch(*args, weight_offset, cache=None)


def qk_norm_rope_kv_write_triton(
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
    """`qk_norm_rope_triton` that also stores the finished keys and the values v [T, Hk, D]
    (last dim contiguous) into kv_cache [2, num_blocks, block_size, Hk, D] at slot_mapping
    [T] (slot < 0 writes nothing), as `write_kv_cache_triton(k_out, v, ...)` does: one
    launch instead of two. Returns (q_out, k_out)."""
    quant = check_kv_write_args(k, v, kv_cache, slot_mapping, k_scale, v_scale)
    check_same_device(q=q, v=v, kv_cache=kv_cache, slot_mapping=slot_mapping)
    cache = (v, kv_cache, slot_mapping, k_scale, v_scale, quant)
    args = (q, k, positions, cos_table, sin_table, q_weight, k_weight, eps, rotary_dim)
    return _launch(*args, weight_offset, cache=cache)


def _launch(
    q, k, positions, cos_table, sin_table, q_weight, k_weight, eps, rotary_dim, weight_offset, cache
):
    """Checks the norm/rotary arguments and runs the kernel; `cache` is None or the checked
    (v, kv_cache, slot_mapping, k_scale, v_scale, quant) of the fused cache write."""
    num_tokens, num_q_heads, head_dim, num_k_heads = _check_qk(q, k)
    rotary_dim = rotary_dim or head_dim
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
        raise ValueError(f"rotary_dim: expected an int, got {rotary_dim!r}")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim: must be even and in (0, {head_dim}], got {rotary_dim}")
    half = rotary_dim // 2
    if positions.dim() != 1 or positions.shape[0] != num_tokens:
        raise ValueError(f"positions: expected shape ({num_tokens},), got {tuple(positions.shape)}")
    if positions.dtype not in POSITION_DTYPES:
        raise ValueError(f"positions: expected int64 or int32, got {positions.dtype}")
    for name, table in (("cos_table", cos_table), ("sin_table", sin_table)):
        if table.dim() != 2 or table.shape[1] != half:
            raise ValueError(
                f"{name}: expected shape (max_pos, {half}) for rotary_dim {rotary_dim}, "
                f"got {tuple(table.shape)}"
            )
        check_dtype(name, table)
        check_last_dim_contiguous(name, table)
    check_shape("sin_table", sin_table, tuple(cos_table.shape))
    has_weight = _check_weights(q, q_weight, k_weight, head_dim, weight_offset)
    check_same_device(
        q=q,
        k=k,
        positions=positions,
        cos_table=cos_table,
        sin_table=sin_table,
        q_weight=q_weight,
        k_weight=k_weight,
    )

    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_k_heads, head_dim), dtype=k.dtype, device=k.device)
    if num_tokens == 0 or num_q_heads + num_k_heads == 0 or head_dim == 0:
        return q_out, k_out
    tokens = tokens_per_program(num_tokens)
    _qk_norm_rope_kernel[(triton.cdiv(num_tokens, tokens), num_q_heads + num_k_heads)](
        q,
        k,
        positions,
        cos_table,
        sin_table,
        q_weight if has_weight else q,  # unread without weights; same dtype keeps one type
        k_weight if has_weight else k,
        q_out,
        k_out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        positions.stride(0),
        cos_table.stride(0),
        sin_table.stride(0),
        float(eps),
        float(weight_offset),
        *_cache_args(cache, k),
        num_tokens,
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=num_k_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        HALF_PAD=next_power_of_2(half),
        PASS_PAD=next_power_of_2(head_dim - rotary_dim) if head_dim > rotary_dim else 0,
        HAS_WEIGHT=has_weight,
        HAS_OFFSET=bool(weight_offset),
        WRITE_CACHE=cache is not None,
        QUANT=cache is not None and cache[-1],
        DIM_PAD=next_power_of_2(head_dim),
        TOKENS=tokens,
        num_warps=min(8, max(1, next_power_of_2(head_dim) // 256)),
        enable_fp_fusion=False,  # round after every op, as torch does
        **pdl_launch(uses_pdl(q)),
    )
    return q_out, k_out


def _cache_args(cache, k: torch.Tensor) -> tuple:
    """The kernel's cache-write arguments from v to v_inv_scale; without a cache write,
    placeholders of fixed types (k stands in for the unread tensors)."""
    if cache is None:
        return (k, k, k, 0, 0, 0, 0, 0, 0, 0, 1, 1.0, 1.0)
    v, kv_cache, slot_mapping, k_scale, v_scale, _ = cache
    return (
        v,
        kv_cache,
        slot_mapping,
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        slot_mapping.stride(0),
        kv_cache.shape[2],
        1.0 / k_scale,
        1.0 / v_scale,
    )


def _check_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int]:
    """Returns (T, Hq, D, Hk) after checking q and k agree."""
    if q.dim() != 3:
        raise ValueError(f"q: expected [T, Hq, D], got shape {tuple(q.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    if k.dim() != 3 or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k: expected [{num_tokens}, Hk, {head_dim}], got {tuple(k.shape)}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"q: head dim {head_dim} exceeds the kernel's limit {MAX_HEAD_DIM}")
    if num_q_heads + k.shape[1] > MAX_HEADS:
        raise ValueError(f"q: Hq + Hk = {num_q_heads + k.shape[1]} exceeds {MAX_HEADS}")
    check_dtype("q", q)
    if k.dtype != q.dtype:
        raise ValueError(f"k: dtype {k.dtype} must match q's {q.dtype}")
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("k", k)
    return num_tokens, num_q_heads, head_dim, k.shape[1]


def _check_weights(
    q: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    head_dim: int,
    weight_offset: float,
) -> bool:
    """True when the norm runs; weights come in pairs, in the activation dtype."""
    if (q_weight is None) != (k_weight is None):
        missing = "k_weight" if k_weight is None else "q_weight"
        raise ValueError(f"{missing}: q_weight and k_weight must be both given or both None")
    if q_weight is None:
        if weight_offset:
            raise ValueError("weight_offset: given without q_weight/k_weight (no norm runs)")
        return False
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        check_shape(name, w, (head_dim,))
        if w.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {w.dtype} must match q's {q.dtype}")
        check_last_dim_contiguous(name, w)
    return True
