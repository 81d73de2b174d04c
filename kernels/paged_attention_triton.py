"""Paged attention over a block-paged KV cache: the Triton kernels.

Same semantics as `paged_attention.paged_attention_ref` (read its docstring for the cache
layout, the `query_start_loc` / `seq_lens` convention and the window): one launch serves
any mix of prefill chunks, decode rows and zero-length rows, and returns the output and
its float32 log-sum-exp (rows with no keys: output 0, lse -inf).

Work split. A program owns one *query block* of one row (up to BLOCK_Q consecutive query
tokens) and one KV head. Its BLOCK_M tile rows are those tokens times the GROUP query
heads that share the KV head (GQA packing), so every key and value tile is loaded once
for all of them and decode rows still fill the matrix units. Query block b of row i is
program `query_start_loc[i] // BLOCK_Q + i + b`; a program finds its row by binary search
over `query_start_loc`, so the grid (`num_tokens // BLOCK_Q + num_rows + 1`) is known
without reading lengths back to the host (CUDA-graph friendly). Programs past a row's
tokens exit; one extra pseudo-row covers tokens past `query_start_loc[-1]` (padding) and
writes them as rows without keys, as the reference does.

The key loop walks tiles of TILE positions from the first position the block's earliest
query can see (window) to the last its latest query can see (causal), gathering each
key's page from the block table, with an online softmax in float32 (base 2). Keys outside
that range are never loaded, so freed or never-written pages (NaN under the sanitizer)
cannot leak in. A tile fully masked for one query row changes nothing in that row.

Two tilings (see `_plans`): rows of a few query tokens (decodes) and longer rows (prefill
chunks) run as two launches of the same kernel, each skipping the other's rows. The
tiling a row gets depends on its own query length only, so a row's result is bitwise the
same whatever else is batched with it (tested).

FP8 cache (`kv_cache_dtype="fp8"`, float8_e4m3fn pages holding values / scale): tiles are
loaded as one byte per element and widened exactly to the query's dtype (every e4m3 value
is a bfloat16, float16 and float32 value), so the dots run as for a cache of q's dtype;
`k_scale` is folded into the score scale and `v_scale` applied to the output once,
instead of scaling every cached element. A bfloat16 / float16 cache under a float32 q (a
DCP shard's float32 partials) is widened the same way, exactly.

Decode context parallelism (`kv_stride > 1`): a DCP rank caches the positions
`kv_offset + i * kv_stride` at local index i, and its block table indexes local tokens
(as `paged_attention_ref` documents). Query positions and `seq_lens` stay global; the
kernel turns a block's global key range into the local indices inside it, walks those,
and masks (causal, window) on each key's global position. `kv_stride` / `kv_offset` are
runtime values, so every rank runs the same compiled kernel; the constexpr STRIDED is
off for the whole cache, so that path compiles exactly as before.

Split-KV (`num_kv_splits > 1`): each program's tile range is cut into that many
contiguous pieces, each written as a float32 partial result with its lse, and the pieces
are merged by the log-sum-exp merge (`merge_attention_states_triton`). The pieces' bounds
move with num_kv_splits, so the answer equals the one-pass kernel's up to float32
rounding, not bitwise; `paged_attention_split_kv_triton` picks the count from the batch
size, so a row's answer would depend on its batch. Kept for benchmarks; not served.

Split-KV decode (`paged_attention_decode_split_triton`, what decode steps run outside the
deterministic mode): splits of a fixed DECODE_KEYS_PER_SPLIT keys, split s of a row
holding its keys [s * KEYS, (s + 1) * KEYS), each a float32 partial at slot s, merged per
row in slot order by `_merge_decode_splits_kernel` (the same `merge_parts` as the general
merge). At batch 1 it spreads a row's keys over up to #SMs programs instead of 8. A
program loops over its row's splits s = split, split + grid, ..., so the grid (sized from
the batch and a host-side bound on the lengths, or fixed in a CUDA graph) spreads work
and never changes a sum: a row's bits depend on its own keys only (tested bitwise against
other batches, grids and buffer sizes). Splits a row does not have are neither written
nor read, so no program is launched only to write an empty partial.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvloom.contracts import envs
from kvloom.kernels.arg_checks_triton import (
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
    is_interpreted,
    next_power_of_2,
)
from kvloom.kernels.device_sms import sm_count
from kvloom.kernels.kv_cache_write import check_scale, is_fp8
from kvloom.kernels.merge_attention_states_triton import (
    merge_attention_states_triton,
    merge_part_rows,
    merge_parts,
)
from kvloom.kernels.pdl_triton import pdl_launch, pdl_release_then_wait, uses_pdl

LOG2E = 1.4426950408889634
MAX_KV_SPLITS = 64
# The split-KV decode's split size, in keys (cache indices, local on a DCP shard). A
# multiple of every plan's key tile (64, 32, 16), so a split is whole tiles. The answer
# depends on it (the merge regroups the sums), so it is one constant, never a function of
# the batch. 256 keys: four 64-key tiles, enough work to amortize a split's q load and
# partial store; 4096 keys at batch 1 become 16 splits x 8 KV heads = 128 programs (about
# one per H200 SM). Timed against 128 and 512 by benchmarks/attention_plans.py.
DECODE_KEYS_PER_SPLIT = 256
# At most this many KV heads (per rank), a short row leaves too few programs at that size:
# Qwen3-Next's 2 heads give a row of 640 keys 6 programs. There the split is half as long
# (a model's constant, never the batch's). Timed on an H100 at Qwen3-Next's heads (16 q,
# 2 KV, 256 dims; docs/benchmarks/data/split_keys_and_router_picks_h100_2026-12-06s22.log):
# one row of 640 keys 13.1 us at 128 keys a split against 18.8 at 256, 4,096 keys 18.1
# against 20.6, 8 rows of 640 13.0 against 18.2, but 8 rows of 4,096 43.6 against 35.9;
# batch-1 Qwen3-Next-16l 1.693 / 1.692 ms a token against 1.718 / 1.739.
FEW_KV_HEADS = 2
# The split-KV decode's grid aims at this many programs per SM (more splits than that run
# one after another in a program; the grid never changes a result).
DECODE_PROGRAMS_PER_SM = 2
ROWS_ALL, ROWS_SHORT, ROWS_LONG = 0, 1, 2  # which rows a launch serves


@triton.jit
def _find_row(qsl_ptr, num_rows, pid, BLOCK_Q: tl.constexpr):
    """Largest row r in [0, num_rows] whose first query block `qsl[r] // BLOCK_Q + r` <= pid.

    Row `num_rows` is the pseudo-row of padding tokens past `qsl[num_rows]`.
    """
    lo = pid * 0
    hi = num_rows + lo
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_block = tl.load(qsl_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        if first_block <= pid:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """a @ b with float32 accumulation.

    INTERPRETED (Triton's CPU interpreter only) sums the float32 products explicitly, the
    k terms in order for every element (half-precision products are exact in float32).
    The interpreter's tl.dot is numpy's matmul, and the BLAS kernel numpy dispatches to
    may round an element differently with its row's position in the tile (OpenBLAS's
    Haswell sgemm kernel does, e.g. on AMD EPYC; its SkylakeX kernel does not), so a
    float32 query would get other bits when its chunk starts elsewhere, where the GPU's
    instructions give every row the same order. The interpreter also gets bfloat16 dots
    wrong."""
    if INTERPRETED:
        c = tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:
        c = tl.dot(a, b, input_precision=PRECISION)
    return c


@triton.jit
def _local_index(pos, kv_stride, kv_offset):
    """The first local index of a DCP shard whose global position is >= pos."""
    return (tl.maximum(pos - kv_offset, 0) + kv_stride - 1) // kv_stride


@triton.jit
def _key_range(
    ctx,
    q_len,
    first_tok,
    last_tok,
    window,
    kv_stride,
    kv_offset,
    HAS_WINDOW: tl.constexpr,
    STRIDED: tl.constexpr,
):
    """[kv_start, kv_end): the cache indices (local on a DCP shard) that query tokens
    first_tok..last_tok of a row with `q_len` query tokens and `ctx` keys can see: up to
    the last one's position, from the first one's window start."""
    kv_end = tl.maximum(ctx - q_len + last_tok + 1, 0)
    if HAS_WINDOW:
        kv_start = tl.maximum(ctx - q_len + first_tok - window + 1, 0)
    else:
        kv_start = kv_end * 0
    if STRIDED:
        kv_start = _local_index(kv_start, kv_stride, kv_offset)
        kv_end = _local_index(kv_end, kv_stride, kv_offset)
    return kv_start, kv_end


@triton.jit
def _split_range(kv_start, kv_end, num_slots, KEYS: tl.constexpr):
    """[s_lo, s_hi): the fixed-size key splits (split s holds cache indices
    [s * KEYS, (s + 1) * KEYS)) that meet [kv_start, kv_end), at most `num_slots`.
    Every split in the range holds at least one of the keys; no keys, no splits."""
    s_lo = kv_start // KEYS
    s_hi = tl.minimum((kv_end + KEYS - 1) // KEYS, num_slots)
    s_hi = tl.where(kv_end > kv_start, s_hi, s_lo)
    return s_lo, s_hi


@triton.jit
def _attend(
    q,
    q_pos,
    kv_ptr,
    table_row,
    tile_lo,
    tile_hi,
    kv_start,
    kv_end,
    kv_head,
    dims,
    dim_ok,
    scale_log2,
    window,
    kv_stride,
    kv_offset,
    stride_ckv,
    stride_cb,
    stride_co,
    stride_ch,
    BLOCK_M: tl.constexpr,
    DIM_PAD: tl.constexpr,
    TILE: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_INTERPRETED: tl.constexpr,
    KV_WIDEN: tl.constexpr,
    STRIDED: tl.constexpr,
):
    """Online softmax (float32, base 2) of q over the key tiles [tile_lo, tile_hi), keys
    outside [kv_start, kv_end) masked: returns (acc, running max, running sum)."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    for t in range(tile_lo, tile_hi):
        k_idx = t * TILE + tl.arange(0, TILE)  # cache index (local on a DCP shard)
        k_ok = (k_idx >= kv_start) & (k_idx < kv_end)
        page = tl.load(table_row + k_idx // PAGE, mask=k_ok, other=0).to(tl.int64)
        k_off = page * stride_cb + (k_idx % PAGE) * stride_co + kv_head * stride_ch
        k = tl.load(
            kv_ptr + k_off[None, :] + dims[:, None],
            mask=k_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )
        # A cache tile of a narrower dtype (FP8, or half under a float32 q) in the
        # query's dtype, exactly (through float32). Inline under a constexpr: Triton 3.6
        # compiles both returns of a helper's constexpr branch and refuses their
        # different types.
        if KV_WIDEN:
            k = k.to(tl.float32).to(q.dtype)
        if STRIDED:
            k_pos = kv_offset + k_idx * kv_stride
        else:
            k_pos = k_idx
        s = _dot(q, k, DOT_PRECISION, DOT_INTERPRETED) * scale_log2
        visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf; shift by 0 to avoid inf - inf.
        m_shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            kv_ptr + stride_ckv + k_off[:, None] + dims[None, :],
            mask=k_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        if KV_WIDEN:
            v = v.to(tl.float32).to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_INTERPRETED)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _store_result(
    acc,
    m_i,
    l_i,
    v_scale,
    out_ptr,
    lse_ptr,
    slot,
    token,
    head,
    dims,
    dim_ok,
    row_ok,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    stride_lh,
    KV_FP8: tl.constexpr,
):
    """Normalizes and stores one result (or one split's partial, at `slot`) with its
    natural-log lse; rows that saw no key get output 0 and lse -inf."""
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]
    if KV_FP8:
        out = out * v_scale
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    slot64 = tl.cast(slot, tl.int64)  # a loop index is a Python int when interpreted
    out_ptrs = out_ptr + slot64 * stride_os + token[:, None] * stride_ot
    out_ptrs = out_ptrs + head[:, None] * stride_oh + dims[None, :]
    tl.store(
        out_ptrs,
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )
    lse_ptrs = lse_ptr + slot64 * stride_ls + token * stride_lt + head * stride_lh
    tl.store(lse_ptrs, lse, mask=row_ok)


@triton.jit
def _store_final(
    acc,
    m_i,
    l_i,
    v_scale,
    fin_ptr,
    fin_lse_ptr,
    token,
    head,
    dims,
    dim_ok,
    row_ok,
    stride_ft,
    stride_fh,
    stride_flt,
    stride_flh,
    KV_FP8: tl.constexpr,
):
    """A row's only split stored as its result: the float32 partial `_store_result` would
    write, then the merge of one part (weight exp(0) = 1 added to a zero sum, divided by
    1), so the bits are those of the partial merged by the merge launch."""
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    part = acc / l_safe[:, None]
    if KV_FP8:
        part = part * v_scale
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    out = (tl.zeros_like(part) + part) / 1.0
    merged_lse = tl.where(has_keys, lse + tl.log(tl.full(lse.shape, 1.0, tl.float32)), lse)
    out_ptrs = fin_ptr + token[:, None] * stride_ft + head[:, None] * stride_fh + dims[None, :]
    tl.store(out_ptrs, out.to(fin_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(fin_lse_ptr + token * stride_flt + head * stride_flh, merged_lse, mask=row_ok)


@triton.jit
def _merge_in_launch(
    s_lo,
    s_hi,
    split,
    grid_splits,
    count_ptr,
    parts_ptr,
    lses_ptr,
    fin_ptr,
    fin_lse_ptr,
    token,
    head,
    dims,
    dim_ok,
    row_ok,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    stride_lh,
    stride_ft,
    stride_fh,
    stride_flt,
    stride_flh,
    BLOCK_M: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    """The merge launch's work, done by the split decode's own programs (MERGE): a row of
    several splits is merged by whichever of its programs stores its last partial (a
    counter per (row, KV head) counts the stored splits; the merging program sets it back
    to 0 for the next launch); a row without keys (padding) gets output 0, lse -inf from
    its split-0 program. The merge reads the partials in split order by `merge_part_rows`,
    so the result is the merge launch's bit for bit."""
    n_splits = s_hi - s_lo
    if n_splits > 1:
        done = (n_splits - split + grid_splits - 1) // grid_splits  # splits this program stored
        if done > 0:
            # Every thread's partial stores before the release; the acquire before any read
            # of the others' partials (the atomic's result reaches every thread through a
            # barrier).
            tl.debug_barrier()
            stored = tl.atomic_add(count_ptr, done, sem="acq_rel", scope="gpu")
            if stored + done == n_splits:
                out, lse = merge_part_rows(
                    lses_ptr + token * stride_lt + head * stride_lh,
                    parts_ptr
                    + token[:, None] * stride_ot
                    + head[:, None] * stride_oh
                    + dims[None, :],
                    stride_ls,
                    stride_os,
                    s_lo,
                    s_hi,
                    row_ok,
                    dim_ok,
                    BLOCK_M,
                    DIM_PAD,
                )
                fin = (
                    fin_ptr + token[:, None] * stride_ft + head[:, None] * stride_fh + dims[None, :]
                )
                tl.store(
                    fin, out.to(fin_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :]
                )
                tl.store(fin_lse_ptr + token * stride_flt + head * stride_flh, lse, mask=row_ok)
                tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")
    if (n_splits == 0) & (split == 0):
        fin = fin_ptr + token[:, None] * stride_ft + head[:, None] * stride_fh + dims[None, :]
        zeros = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
        tl.store(fin, zeros.to(fin_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
        no_keys = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        tl.store(fin_lse_ptr + token * stride_flt + head * stride_flh, no_keys, mask=row_ok)


# Lengths change every step: no recompiles for their values (e.g. 1 or multiples of 16);
# nor for the DCP rank (offset 0 would otherwise compile apart, as a multiple of 16).
@triton.jit(
    do_not_specialize=["num_rows", "num_tokens", "window", "kv_stride", "kv_offset", "num_slots"]
)
def _paged_attention_kernel(
    q_ptr,
    kv_ptr,
    block_tables_ptr,
    qsl_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    scale_log2,
    v_scale,
    num_rows,
    num_tokens,
    window,
    kv_stride,
    kv_offset,
    num_slots,
    stride_qt,
    stride_qh,
    stride_ckv,
    stride_cb,
    stride_co,
    stride_ch,
    stride_bt,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    stride_lh,
    fin_ptr,
    fin_lse_ptr,
    count_ptr,
    stride_ft,
    stride_fh,
    stride_flt,
    stride_flh,
    stride_count,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    KEYS_PER_SPLIT: tl.constexpr,
    ROWS: tl.constexpr,
    SHORT_ROW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_INTERPRETED: tl.constexpr,
    KV_FP8: tl.constexpr,
    KV_WIDEN: tl.constexpr,
    STRIDED: tl.constexpr,
    MERGE: tl.constexpr = False,
    GDC: tl.constexpr = 0,
):
    pdl_release_then_wait(GDC)  # kernels/pdl_triton.py
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    row = _find_row(qsl_ptr, num_rows, pid, BLOCK_Q)
    is_real = row < num_rows
    q_start = tl.load(qsl_ptr + row).to(tl.int32)
    q_end = tl.load(qsl_ptr + row + 1, mask=is_real, other=num_tokens).to(tl.int32)
    ctx = tl.load(seq_lens_ptr + row, mask=is_real, other=0).to(tl.int32)
    q_len = q_end - q_start
    first_tok = (pid - (q_start // BLOCK_Q + row)) * BLOCK_Q
    # ROWS picks the rows this launch serves: all, short ones (q_len <= SHORT_ROW) or long.
    mine = first_tok < q_len
    if ROWS == 1:
        if MERGE:  # the padding tokens' outputs (0, lse -inf) are this launch's to write
            mine = mine & ((q_len <= SHORT_ROW) | (row == num_rows))
        else:
            mine = mine & (q_len <= SHORT_ROW)
    if ROWS == 2:
        mine = mine & (q_len > SHORT_ROW)

    if mine:
        offs_m = tl.arange(0, BLOCK_M)
        tok = first_tok + offs_m // GROUP
        head = kv_head * GROUP + offs_m % GROUP
        row_ok = (offs_m // GROUP < BLOCK_Q) & (tok < q_len)
        token = (q_start + tok).to(tl.int64)
        q_pos = ctx - q_len + tok
        dims = tl.arange(0, DIM_PAD)
        dim_ok = dims < HEAD_DIM

        q = tl.load(
            q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )

        # Keys this block can see (global positions; a DCP shard walks the local indices
        # of its keys in that range).
        last_tok = tl.minimum(first_tok + BLOCK_Q, q_len) - 1
        kv_start, kv_end = _key_range(
            ctx, q_len, first_tok, last_tok, window, kv_stride, kv_offset, HAS_WINDOW, STRIDED
        )
        tile_lo = kv_start // TILE
        tile_hi = tl.maximum((kv_end + TILE - 1) // TILE, tile_lo)
        table_row = block_tables_ptr + row.to(tl.int64) * stride_bt
        if KEYS_PER_SPLIT == 0:
            if NUM_SPLITS > 1:
                per_split = (tile_hi - tile_lo + NUM_SPLITS - 1) // NUM_SPLITS
                tile_lo = tl.minimum(tile_lo + split * per_split, tile_hi)
                tile_hi = tl.minimum(tile_lo + per_split, tile_hi)
            acc, m_i, l_i = _attend(
                q,
                q_pos,
                kv_ptr,
                table_row,
                tile_lo,
                tile_hi,
                kv_start,
                kv_end,
                kv_head,
                dims,
                dim_ok,
                scale_log2,
                window,
                kv_stride,
                kv_offset,
                stride_ckv,
                stride_cb,
                stride_co,
                stride_ch,
                BLOCK_M,
                DIM_PAD,
                TILE,
                PAGE,
                HAS_WINDOW,
                DOT_PRECISION,
                DOT_INTERPRETED,
                KV_WIDEN,
                STRIDED,
            )
            _store_result(
                acc,
                m_i,
                l_i,
                v_scale,
                out_ptr,
                lse_ptr,
                split,
                token,
                head,
                dims,
                dim_ok,
                row_ok,
                stride_os,
                stride_ot,
                stride_oh,
                stride_ls,
                stride_lt,
                stride_lh,
                KV_FP8,
            )
        else:
            # Fixed-size splits: split s covers cache indices [s * KEYS, (s + 1) * KEYS),
            # whatever the grid, and is written at slot s. This program takes splits
            # split, split + grid, ... of its row: the grid changes the work per program,
            # never a split's sums.
            s_lo, s_hi = _split_range(kv_start, kv_end, num_slots, KEYS_PER_SPLIT)
            for s in range(s_lo + split, s_hi, tl.num_programs(2)):
                acc, m_i, l_i = _attend(
                    q,
                    q_pos,
                    kv_ptr,
                    table_row,
                    tl.maximum(tile_lo, s * (KEYS_PER_SPLIT // TILE)),
                    tl.minimum(tile_hi, (s + 1) * (KEYS_PER_SPLIT // TILE)),
                    kv_start,
                    kv_end,
                    kv_head,
                    dims,
                    dim_ok,
                    scale_log2,
                    window,
                    kv_stride,
                    kv_offset,
                    stride_ckv,
                    stride_cb,
                    stride_co,
                    stride_ch,
                    BLOCK_M,
                    DIM_PAD,
                    TILE,
                    PAGE,
                    HAS_WINDOW,
                    DOT_PRECISION,
                    DOT_INTERPRETED,
                    KV_WIDEN,
                    STRIDED,
                )
                direct = False  # MERGE: a row's only split is its result (no partial, no merge)
                if MERGE:
                    direct = s_hi - s_lo == 1
                if direct:
                    _store_final(
                        acc, m_i, l_i, v_scale, fin_ptr, fin_lse_ptr, token, head, dims, dim_ok,
                        row_ok, stride_ft, stride_fh, stride_flt, stride_flh, KV_FP8,
                    )  # fmt: skip
                else:
                    _store_result(
                        acc,
                        m_i,
                        l_i,
                        v_scale,
                        out_ptr,
                        lse_ptr,
                        s,
                        token,
                        head,
                        dims,
                        dim_ok,
                        row_ok,
                        stride_os,
                        stride_ot,
                        stride_oh,
                        stride_ls,
                        stride_lt,
                        stride_lh,
                        KV_FP8,
                    )
            if MERGE:
                _merge_in_launch(
                    s_lo, s_hi, split, tl.num_programs(2), count_ptr + row * stride_count + kv_head,
                    out_ptr, lse_ptr, fin_ptr, fin_lse_ptr, token, head, dims, dim_ok, row_ok,
                    stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_lh, stride_ft,
                    stride_fh, stride_flt, stride_flh, BLOCK_M, DIM_PAD,
                )  # fmt: skip


@triton.jit(do_not_specialize=["window", "kv_stride", "kv_offset", "num_slots"])
def _merge_decode_splits_kernel(
    parts_ptr,
    lses_ptr,
    qsl_ptr,
    seq_lens_ptr,
    out_ptr,
    out_lse_ptr,
    window,
    kv_stride,
    kv_offset,
    num_slots,
    stride_pp,
    stride_pt,
    stride_ph,
    stride_lp,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    stride_olt,
    stride_olh,
    KEYS_PER_SPLIT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    STRIDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    GDC: tl.constexpr = 0,
):
    """Merges one (token, head)'s fixed-size splits, in split order. Token t is row t's
    one query token (decode layout); a token that is not (padding past the real rows)
    gets no splits: output 0, lse -inf. The split range is the attention kernel's, from
    the same helpers, so exactly the slots it wrote are read."""
    pdl_release_then_wait(GDC)  # kernels/pdl_triton.py
    token = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    q_start = tl.load(qsl_ptr + token)
    q_end = tl.load(qsl_ptr + token + 1)
    is_decode = (q_start == token) & (q_end == token + 1)
    ctx = tl.load(seq_lens_ptr + token, mask=is_decode, other=0).to(tl.int32)
    kv_start, kv_end = _key_range(ctx, 1, 0, 0, window, kv_stride, kv_offset, HAS_WINDOW, STRIDED)
    s_lo, s_hi = _split_range(kv_start, kv_end, num_slots, KEYS_PER_SPLIT)
    token64 = token.to(tl.int64)
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    out, lse = merge_parts(
        lses_ptr + token64 * stride_lt + head * stride_lh,
        parts_ptr + token64 * stride_pt + head * stride_ph,
        stride_lp,
        stride_pp,
        s_lo,
        s_hi,
        dims,
        dim_ok,
        DIM_PAD,
    )
    tl.store(out_ptr + token64 * stride_ot + head * stride_oh + dims, out, mask=dim_ok)
    tl.store(out_lse_ptr + token64 * stride_olt + head * stride_olh, lse)


def _plans(group: int, head_dim: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """(short-row plan, long-row plan), from the model's shape only.

    Rows of at most the short plan's BLOCK_Q query tokens (decodes, speculative
    verification) take small query tiles and long key tiles: they are bound by reading
    the cache. Longer rows (prefill chunks) take taller query tiles for the matrix units.
    Which plan serves a row depends on that row's query length alone, so a row's result
    does not depend on what else is batched with it.
    """
    dim_pad = max(16, next_power_of_2(head_dim))
    wide = dim_pad > 128 or dtype == torch.float32
    short_m = max(16, next_power_of_2(group))
    short = {
        "BLOCK_M": short_m,
        "BLOCK_Q": short_m // group,
        "TILE": 32 if wide else 64,
        "DIM_PAD": dim_pad,
        "num_warps": 4,
        "num_stages": 3,
    }
    long_m = max(32 if wide else 64, next_power_of_2(group))
    long = {
        "BLOCK_M": long_m,
        "BLOCK_Q": long_m // group,
        "TILE": 32,
        "DIM_PAD": dim_pad,
        "num_warps": 4,
        "num_stages": 2,
    }
    if dim_pad > 256:
        # MLA's absorbed rows (kv_lora_rank + rope dims, e.g. 576 -> 1024): key and value
        # tiles this wide fit Hopper's shared memory only short and shallowly pipelined.
        short.update(TILE=16, num_stages=2, num_warps=8)
        long.update(TILE=16, num_stages=1, num_warps=8)
    return short, long


def cache_readable(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """The caches the kernel reads under a q of q_dtype: q's dtype, FP8, or a half type
    under a float32 q (widened exactly, e.g. a DCP shard computing float32 partials)."""
    if cache_dtype == q_dtype or is_fp8(cache_dtype):
        return True
    return q_dtype == torch.float32 and cache_dtype in (torch.bfloat16, torch.float16)


def _check_shard(kv_stride, kv_offset):
    for name, value in (("kv_stride", kv_stride), ("kv_offset", kv_offset)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}: expected an int, got {value!r}")
    if kv_stride < 1 or not 0 <= kv_offset < kv_stride:
        raise ValueError(
            f"kv_stride / kv_offset: expected kv_stride >= 1 and 0 <= kv_offset < kv_stride, "
            f"got {kv_stride} / {kv_offset}"
        )


def check_paging_args(block_tables, query_start_loc, seq_lens) -> None:
    """The row layout every paged kernel reads: seq_lens [R], query_start_loc [R + 1],
    block_tables [>= R, max_blocks], integer, rows contiguous."""
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens: expected [num_rows], got shape {tuple(seq_lens.shape)}")
    num_rows = seq_lens.shape[0]
    if query_start_loc.shape != (num_rows + 1,):
        raise ValueError(
            f"query_start_loc: expected shape ({num_rows + 1},), got {tuple(query_start_loc.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] < num_rows:
        raise ValueError(
            f"block_tables: expected [>= {num_rows}, max_blocks], got {tuple(block_tables.shape)}"
        )
    for name, t in (
        ("block_tables", block_tables),
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
    ):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: expected int32 or int64, got {t.dtype}")
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError("block_tables: rows must be contiguous")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if t.numel() > 1 and t.stride(0) != 1:
            raise ValueError(f"{name}: must be contiguous")


def _check_args(q, kv_cache, block_tables, query_start_loc, seq_lens, sliding_window):
    if q.dim() != 3:
        raise ValueError(f"q: expected [T, Hq, D], got shape {tuple(q.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[4] != head_dim:
        raise ValueError(
            f"kv_cache: expected [2, num_blocks, block_size, Hkv, {head_dim}], "
            f"got {tuple(kv_cache.shape)}"
        )
    num_kv_heads = kv_cache.shape[3]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q: {num_q_heads} query heads is not a multiple of kv_cache's {num_kv_heads}"
        )
    check_dtype("q", q)
    if not cache_readable(q.dtype, kv_cache.dtype):
        raise ValueError(
            f"kv_cache: dtype {kv_cache.dtype} is neither q's {q.dtype} nor float8_e4m3fn "
            "(nor bfloat16 / float16 under a float32 q)"
        )
    check_paging_args(block_tables, query_start_loc, seq_lens)
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("kv_cache", kv_cache)
    check_same_device(
        q=q,
        kv_cache=kv_cache,
        block_tables=block_tables,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
    )
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        raise ValueError(f"sliding_window: expected a positive int or None, got {sliding_window!r}")


def _launch(
    rows,
    short_row,
    q,
    kv_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    scale,
    sliding_window,
    num_splits,
    out,
    lse,
    plan,
    k_scale=1.0,
    v_scale=1.0,
    kv_stride=1,
    kv_offset=0,
    keys_per_split=0,
    num_slots=1,
    merge=None,
):
    """One launch. `num_splits`: the grid's split dimension. With `keys_per_split` > 0
    (the fixed-size splits of the decode path) out / lse are the [num_slots, T, ...]
    partials and each program loops over its row's splits; else num_splits > 1 cuts
    every program's keys into that many pieces, one per grid index. `merge`: (result,
    result lse, counters [T, Hkv] int32 zeros) where the split decode merges its splits
    in this launch (MERGE)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, page = kv_cache.shape[3], kv_cache.shape[2]
    group = num_q_heads // num_kv_heads
    num_rows = seq_lens.shape[0]
    fp8 = is_fp8(kv_cache.dtype)
    partials = num_splits > 1 or keys_per_split > 0
    split_stride_out = out.stride(0) if partials else 0
    split_stride_lse = lse.stride(0) if partials else 0
    out_t, lse_t = (out[0], lse[0]) if partials else (out, lse)
    # Without `merge`, placeholders of fixed types (never read: MERGE is off).
    fin, fin_lse, counters = merge if merge is not None else (out_t, lse_t, seq_lens[:, None])
    grid = (num_tokens // plan["BLOCK_Q"] + num_rows + 1, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        q,
        kv_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        lse,
        float(scale) * LOG2E * (k_scale if fp8 else 1.0),
        float(v_scale),
        num_rows,
        num_tokens,
        sliding_window or 0,
        kv_stride,
        kv_offset,
        num_slots,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        split_stride_out,
        out_t.stride(0),
        out_t.stride(1),
        split_stride_lse,
        lse_t.stride(0),
        lse_t.stride(1),
        fin,
        fin_lse,
        counters,
        fin.stride(0),
        fin.stride(1),
        fin_lse.stride(0),
        fin_lse.stride(1),
        counters.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        DIM_PAD=plan["DIM_PAD"],
        BLOCK_M=plan["BLOCK_M"],
        BLOCK_Q=plan["BLOCK_Q"],
        TILE=plan["TILE"],
        PAGE=page,
        HAS_WINDOW=sliding_window is not None,
        NUM_SPLITS=1 if keys_per_split else num_splits,
        KEYS_PER_SPLIT=keys_per_split,
        ROWS=rows,
        SHORT_ROW=short_row,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_INTERPRETED=is_interpreted(_paged_attention_kernel),
        KV_FP8=fp8,
        KV_WIDEN=kv_cache.dtype != q.dtype,
        STRIDED=kv_stride > 1,
        MERGE=merge is not None,
        num_warps=plan["num_warps"],
        num_stages=plan["num_stages"],
        **pdl_launch(uses_pdl(q)),
    )


def _outputs(q, out, lse) -> tuple[torch.Tensor, torch.Tensor]:
    """The result buffers: the given ones, checked, or new ones."""
    num_tokens, num_q_heads, _ = q.shape
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(
            f"out: expected {q.dtype} of shape {tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}"
        )
    check_last_dim_contiguous("out", out)
    if lse is None:
        lse = torch.empty((num_tokens, num_q_heads), dtype=torch.float32, device=q.device)
    if lse.shape != (num_tokens, num_q_heads) or lse.dtype != torch.float32:
        raise ValueError(
            f"lse: expected float32 of shape ({num_tokens}, {num_q_heads}), got {lse.dtype} "
            f"{tuple(lse.shape)}"
        )
    check_same_device(q=q, out=out, lse=lse)
    return out, lse


def paged_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    num_kv_splits: int = 1,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    max_query_len: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_stride: int = 1,
    kv_offset: int = 0,
    _plan_override: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D]; returns (out [T, Hq, D] in q's dtype, lse [T, Hq] float32).

    `num_kv_splits > 1` takes the split-KV path (see the module docstring). `out` / `lse`
    may be given to write into (shapes and dtypes as returned). `max_query_len`, a host-side
    bound on the rows' query lengths (1 for a decode batch), skips the launch for long rows
    when none can exist; a true bound never changes a result, a false one leaves longer
    rows unwritten. No host sync: lengths stay on the device. Rows must not need more pages
    than `block_tables` has columns. `k_scale` / `v_scale`: the per-tensor scales of an FP8
    cache (unused for other cache dtypes). `kv_stride` / `kv_offset`: this DCP rank's
    share of the positions (see the module docstring; 1 / 0 is the whole cache).
    """
    _check_args(q, kv_cache, block_tables, query_start_loc, seq_lens, sliding_window)
    _check_shard(kv_stride, kv_offset)
    check_scale("k_scale", k_scale)
    check_scale("v_scale", v_scale)
    if max_query_len is not None and (
        isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 0
    ):
        raise ValueError(
            f"max_query_len: expected a non-negative int or None, got {max_query_len!r}"
        )
    if isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, int):
        raise ValueError(f"num_kv_splits: expected an int, got {num_kv_splits!r}")
    if not 1 <= num_kv_splits <= MAX_KV_SPLITS:
        raise ValueError(f"num_kv_splits: must be in [1, {MAX_KV_SPLITS}], got {num_kv_splits}")
    num_tokens, num_q_heads, head_dim = q.shape
    out, lse = _outputs(q, out, lse)
    if num_tokens == 0 or num_q_heads == 0:
        return out, lse
    if num_kv_splits == 1:
        dst_out, dst_lse = out, lse
    else:
        dst_out = torch.empty(
            (num_kv_splits, num_tokens, num_q_heads, head_dim),
            dtype=torch.float32,
            device=q.device,
        )
        dst_lse = torch.empty(
            (num_kv_splits, num_tokens, num_q_heads), dtype=torch.float32, device=q.device
        )
    args = (q, kv_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window)
    scales = (k_scale, v_scale, kv_stride, kv_offset)
    if _plan_override is not None:
        _launch(ROWS_ALL, 0, *args, num_kv_splits, dst_out, dst_lse, _plan_override, *scales)
    else:
        short, long = _plans(num_q_heads // kv_cache.shape[3], head_dim, q.dtype)
        short_row = short["BLOCK_Q"]
        _launch(ROWS_SHORT, short_row, *args, num_kv_splits, dst_out, dst_lse, short, *scales)
        if max_query_len is None or max_query_len > short_row:
            _launch(ROWS_LONG, short_row, *args, num_kv_splits, dst_out, dst_lse, long, *scales)
    if num_kv_splits == 1:
        return out, lse
    return merge_attention_states_triton(dst_out, dst_lse, out=out, out_lse=lse)


def choose_num_kv_splits(
    num_rows: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int,
    keys_per_split: int = 128,
) -> int:
    """A split count for a decode launch: enough programs to fill the GPU about four times
    over (measured best on an H200 for batch 1 to 8), but each split keeps at least
    `keys_per_split` keys. Depends only on the launch shape."""
    programs = max(1, num_rows * num_kv_heads)
    want = max(1, (4 * num_sms) // programs)
    most_useful = max(1, math.ceil(max_seq_len / keys_per_split))
    return int(min(want, most_useful, MAX_KV_SPLITS))


def paged_attention_split_kv_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    max_seq_len: int,
    max_query_len: int | None = None,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_stride: int = 1,
    kv_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV paged attention for long-context decode at small batch, its split count
    from the batch size (not batch invariant: the serving path runs
    `paged_attention_decode_split_triton`).

    `max_seq_len` (a host-side bound on `seq_lens`, e.g. the model's max length for CUDA
    graphs) sizes the split count when `num_kv_splits` is None; a DCP shard
    (`kv_stride` > 1) holds about max_seq_len / kv_stride keys and is sized by that.
    """
    if num_kv_splits is None:
        local_len = -(-max_seq_len // kv_stride)
        num_kv_splits = choose_num_kv_splits(
            seq_lens.shape[0], kv_cache.shape[3], local_len, sm_count(q.device)
        )
    return paged_attention_triton(
        q,
        kv_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        sliding_window,
        num_kv_splits=num_kv_splits,
        out=out,
        lse=lse,
        max_query_len=max_query_len,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_stride=kv_stride,
        kv_offset=kv_offset,
    )


# -- split-KV decode, batch invariant --------------------------------------------------------


def decode_keys_per_split(num_kv_heads: int) -> int:
    """The split decode's split size for a cache of `num_kv_heads` heads on this rank:
    DECODE_KEYS_PER_SPLIT, halved where FEW_KV_HEADS or fewer would leave a short row only a
    few programs. A function of the model and TP size alone, so a row's bits still depend
    on its own keys only."""
    if num_kv_heads <= FEW_KV_HEADS:
        return DECODE_KEYS_PER_SPLIT // 2
    return DECODE_KEYS_PER_SPLIT


def decode_split_slots(
    block_tables: torch.Tensor, kv_cache: torch.Tensor, keys_per_split: int = DECODE_KEYS_PER_SPLIT
) -> int:
    """The most fixed-size splits a row can have: its block table's capacity in keys (local
    keys on a DCP shard, whose pages are local) over the split size. Sizes the partials."""
    return max(1, -(-block_tables.shape[1] * kv_cache.shape[2] // keys_per_split))


# The split decode's key tile and pipelining where a split holds whole 128-key tiles and
# the short plan's tile is the narrow one for heads of at most 128 dims in a half type.
# Timed in CUDA graphs on an H100 (Qwen3-8B heads, 256 keys a split; attention_plans.py
# --short-plans, docs/benchmarks/data/split_decode_plans_h100_2026-12-06s19.json): 7.5
# against 9.1 us at one row of 128 keys, 13.3 against 15.5 at 4,096, 12.9 against 16.1 at
# 8 rows of 640, 65.5 against 64.5 at 8 rows of 4,096. A split's sums then run over other
# tiles (other bits than the 64-key tile's), still the row's own keys alone.
DECODE_SPLIT_PLAN = {"TILE": 128, "num_warps": 4, "num_stages": 2}


def decode_split_plan(short: dict, keys_per_split: int) -> dict:
    """The plan the split decode's attention launch runs: the short-row plan, with
    DECODE_SPLIT_PLAN's tile where that plan's tile is 64 keys and keys_per_split holds
    whole 128-key tiles (never the float32, wide-head or MLA plans)."""
    if DECODE_SPLIT_PLAN is None or short["TILE"] != 64:
        return short
    if keys_per_split % DECODE_SPLIT_PLAN["TILE"]:
        return short
    return {**short, **DECODE_SPLIT_PLAN}


def decode_split_grid(num_rows: int, num_kv_heads: int, max_splits: int, num_sms: int) -> int:
    """The grid's split dimension: DECODE_PROGRAMS_PER_SM programs per SM, no more than
    the splits a row may have. It sets how the work is spread, never a result."""
    want = -(-DECODE_PROGRAMS_PER_SM * num_sms // max(1, num_rows * num_kv_heads))
    return max(1, min(want, max_splits))


def uses_split_merge(q: torch.Tensor) -> bool:
    """Whether the split decode merges in its attention launch: the opt-in `split_merge`
    (KVLOOM_FUSED) on a GPU. Never interpreted: the counter's cross-program order is
    what the GPU test checks (tests call the kernel with merge_in_launch=True)."""
    return q.is_cuda and not envs.unfused("split_merge")


def _split_counters(counters, num_tokens: int, num_kv_heads: int, device) -> torch.Tensor:
    """The in-launch merge's counters: the given int32 zeros [>= T, Hkv] or new ones."""
    if counters is None:
        return torch.zeros((num_tokens, num_kv_heads), dtype=torch.int32, device=device)
    if (
        counters.dtype != torch.int32
        or counters.dim() != 2
        or counters.shape[0] < num_tokens
        or counters.shape[1] != num_kv_heads
        or counters.stride(1) != 1
    ):
        raise ValueError(
            f"counters: expected int32 [>= {num_tokens}, {num_kv_heads}] with contiguous "
            f"rows, got {counters.dtype} {tuple(counters.shape)}"
        )
    return counters


def _split_buffers(parts, part_lses, slots, q):
    """Float32 partials [slots, T, Hq, D] and their lse [slots, T, Hq]: views of the given
    buffers (at least that large, e.g. a CUDA graph's scratch) or new ones."""
    num_tokens, num_heads, head_dim = q.shape
    device = q.device
    if parts is None or part_lses is None:
        if parts is not None or part_lses is not None:
            raise ValueError("parts / part_lses: give both or neither")
        parts = torch.empty(
            (slots, num_tokens, num_heads, head_dim), dtype=torch.float32, device=device
        )
        part_lses = torch.empty((slots, num_tokens, num_heads), dtype=torch.float32, device=device)
        return parts, part_lses
    for name, t, tail in (
        ("parts", parts, (num_heads, head_dim)),
        ("part_lses", part_lses, (num_heads,)),
    ):
        if (
            t.dtype != torch.float32
            or t.dim() != 2 + len(tail)
            or tuple(t.shape[2:]) != tail
            or t.shape[0] < slots
            or t.shape[1] < num_tokens
        ):
            raise ValueError(
                f"{name}: expected float32 [>= {slots}, >= {num_tokens}, "
                f"{', '.join(map(str, tail))}], got {t.dtype} {tuple(t.shape)}"
            )
    check_last_dim_contiguous("parts", parts)
    check_same_device(parts=parts, part_lses=part_lses, q=q)
    return parts[:slots, :num_tokens], part_lses[:slots, :num_tokens]


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def paged_attention_decode_split_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    max_seq_len: int | None = None,
    parts: torch.Tensor | None = None,
    part_lses: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_stride: int = 1,
    kv_offset: int = 0,
    keys_per_split: int = DECODE_KEYS_PER_SPLIT,
    grid_splits: int | None = None,
    merge_in_launch: bool | None = None,
    counters: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV paged attention of a decode batch, batch invariant. Arguments and results
    as `paged_attention_triton`'s; the batch must have the decode layout: token i is row
    i's only query token (T = rows; rows past the real ones may be zero-length with
    seq_len 0, as CUDA-graph padding is).

    Split s of a row holds its cache indices [s * keys_per_split, (s + 1) *
    keys_per_split) (local indices on a DCP shard; the splits its window leaves out are
    skipped). Each split is attended with the decode plan's key tiles into a float32
    partial at slot s, then one launch merges the row's splits in slot order. A row's
    result therefore depends on its own keys and `keys_per_split` only: not on the other
    rows, the batch size, `max_seq_len`, `grid_splits` or the partial buffers' size
    (tested bitwise). It equals the one-pass kernel's up to float32 rounding.

    `max_seq_len`: a host-side bound on seq_lens (e.g. the model's max length in a CUDA
    graph) that sizes the grid; only speed depends on it (None: the block table's
    capacity). `parts` / `part_lses`: float32 buffers of at least [slots, T, Hq, D] /
    [slots, T, Hq] to reuse (a CUDA graph's scratch; slots = `decode_split_slots`), else
    allocated per call. `grid_splits` overrides the grid's split dimension (tests).

    `merge_in_launch` (None: the opt-in `split_merge` of contracts/envs.py): no merge
    launch; a row's only split is stored as its result, and a row of several is merged,
    in the same order, by its program that stores the last partial (the same bits as the
    two launches). It counts stored splits in `counters`, int32 zeros of at least [T, Hkv]
    (a CUDA graph's scratch; left zero after each call), else allocated per call.
    """
    _check_args(q, kv_cache, block_tables, query_start_loc, seq_lens, sliding_window)
    _check_shard(kv_stride, kv_offset)
    check_scale("k_scale", k_scale)
    check_scale("v_scale", v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    num_rows, num_kv_heads = seq_lens.shape[0], kv_cache.shape[3]
    if num_tokens != num_rows:
        raise ValueError(
            f"q: the decode layout has one query token per row: {num_tokens} tokens for "
            f"{num_rows} rows"
        )
    short, _ = _plans(num_q_heads // num_kv_heads, head_dim, q.dtype)
    _positive_int("keys_per_split", keys_per_split)
    short = decode_split_plan(short, keys_per_split)
    if keys_per_split % short["TILE"]:
        raise ValueError(
            f"keys_per_split: must be a multiple of the key tile {short['TILE']}, got "
            f"{keys_per_split}"
        )
    if grid_splits is not None:
        _positive_int("grid_splits", grid_splits)
    if max_seq_len is not None:
        _positive_int("max_seq_len", max_seq_len)
    out, lse = _outputs(q, out, lse)
    if num_tokens == 0 or num_q_heads == 0:
        return out, lse
    slots = decode_split_slots(block_tables, kv_cache, keys_per_split)
    parts, part_lses = _split_buffers(parts, part_lses, slots, q)
    if merge_in_launch is None:
        merge_in_launch = uses_split_merge(q)
    if merge_in_launch:
        counters = _split_counters(counters, num_tokens, num_kv_heads, q.device)
    if grid_splits is None:
        most = slots
        if max_seq_len is not None:
            local_len = -(-max_seq_len // kv_stride)
            most = min(most, -(-local_len // keys_per_split))
        grid_splits = decode_split_grid(num_rows, num_kv_heads, most, sm_count(q.device))
    _launch(
        ROWS_SHORT,
        short["BLOCK_Q"],
        q,
        kv_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        sliding_window,
        grid_splits,
        parts,
        part_lses,
        short,
        k_scale,
        v_scale,
        kv_stride,
        kv_offset,
        keys_per_split,
        slots,
        merge=(out, lse, counters) if merge_in_launch else None,
    )
    if merge_in_launch:
        return out, lse
    _merge_decode_splits_kernel[(num_tokens, num_q_heads)](
        parts,
        part_lses,
        query_start_loc,
        seq_lens,
        out,
        lse,
        sliding_window or 0,
        kv_stride,
        kv_offset,
        slots,
        parts.stride(0),
        parts.stride(1),
        parts.stride(2),
        part_lses.stride(0),
        part_lses.stride(1),
        part_lses.stride(2),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        lse.stride(1),
        KEYS_PER_SPLIT=keys_per_split,
        HAS_WINDOW=sliding_window is not None,
        STRIDED=kv_stride > 1,
        HEAD_DIM=head_dim,
        DIM_PAD=next_power_of_2(head_dim),
        **pdl_launch(uses_pdl(q)),
    )
    return out, lse
