"""Absorbed MLA attention over a paged latent cache: the Triton kernel.

Same semantics as `mla_attention.mla_attention_ref` (read its docstring): per cached token
one row [c (r) | k_pe (dr)]; every query head's key is the whole row and its value is c.
One launch serves any mix of prefill chunks, decode rows, zero-length rows and graph
padding, with lengths on the device (no host sync: CUDA-graph safe), and returns
o_latent [T, H, r] in q's dtype and its float32 log-sum-exp [T, H].

Unlike the generic paged kernel over `latent_cache_as_kv` (keys = values = the 576-wide
row, padded to 1024 for both dots), the score is dot(q_latent, c) + dot(q_pe, k_pe) with
r and dr each padded on its own to a power of two >= 16 (512 and 64 for Kimi-Linear and
DeepSeek: no padding), and each key tile's c is loaded once and used as key and value.

Work split. MLA has one KV head. A program owns one *query block* of one row (BLOCK_Q
consecutive query tokens) and one *head block* (HEAD_BLOCK consecutive query heads): its
BLOCK_M tile rows are those tokens times those heads (the generic kernel's GQA packing),
so each cache tile is loaded once for all of them. HEAD_BLOCK is 16 (the smallest M of a
matrix-unit dot) or all heads when fewer: a batch-1 decode at 32 heads gets two programs,
and at 16 heads or fewer every decode row still fills the dot. Program
`pid = query_block * NUM_HEAD_BLOCKS + head_block` (head blocks of a row adjacent, so they
read its pages while they sit in L2); the query block and its row come from `_find_row`
over `query_start_loc` as in `paged_attention_triton`, so the grid,
`(num_tokens // BLOCK_Q + num_rows + 1) * NUM_HEAD_BLOCKS`, is known without reading
lengths back. The extra pseudo-row covers tokens past `query_start_loc[-1]` (padding)
and writes them as rows without keys (output 0, lse -inf).

The key loop walks tiles of TILE absolute positions from 0 to the last position the
block's last query can see, gathering each key's page from the block table, with an
online softmax in float32 (base 2). Keys at or past a row's context are never loaded, so
never-written pages (NaN under the sanitizer) cannot leak in.

Batch invariance. There is one plan per model shape (`mla_plan`: heads and dtype),
for decode rows and prefill chunks alike; no launch parameter depends on the batch. A
query token's result is the same sequence of tiles at the same absolute positions, each
a dot whose per-element order does not depend on the token's tile row; a tile that is
fully masked for a token (past its own position, in its query block's range) leaves
that token's m, l and accumulator exactly as they were. So a row's result is bitwise
the same whatever else is batched, and a token computed in a prefill chunk equals the
same token computed as a decode (tested interpreted; the deterministic mode needs no
separate MLA plan). Prefill chunks take the same plan: a taller-tile prefill plan would
hold a several times larger [BLOCK_M, r] float32 accumulator and lose that equality.

FP8 cache (float8_e4m3fn rows holding row / kv_scale): tiles are loaded as bytes and
widened exactly to q's dtype, `kv_scale` is folded into the score scale and applied once
to the output, as `paged_attention_triton` does. Any other cache has q's dtype.

Decode context parallelism is not supported: the model runner refuses DCP > 1 for MLA
layers (`ModelRunner._attach_dcp`), so no strided shard ever reaches this kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.kernels.arg_checks_triton import (
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
    is_interpreted,
    next_power_of_2,
)
from kvloom.kernels.kv_cache_write import check_scale, is_fp8
from kvloom.kernels.paged_attention_triton import (
    LOG2E,
    _dot,
    _find_row,
    check_paging_args,
)

HEAD_BLOCK = 16  # query heads per program: the smallest M of a tensor-core dot


# Lengths change every step: no recompiles for their values.
@triton.jit(do_not_specialize=["num_rows", "num_tokens"])
def _mla_attention_kernel(
    q_ptr,
    q_pe_ptr,
    cache_ptr,
    block_tables_ptr,
    qsl_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    scale_log2,
    out_scale,
    num_rows,
    num_tokens,
    stride_qt,
    stride_qh,
    stride_pt,
    stride_ph,
    stride_cb,
    stride_co,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    NUM_HEADS: tl.constexpr,
    NUM_HEAD_BLOCKS: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE: tl.constexpr,
    PAGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_INTERPRETED: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    pid = tl.program_id(0)
    head_block = pid % NUM_HEAD_BLOCKS
    query_block = pid // NUM_HEAD_BLOCKS

    row = _find_row(qsl_ptr, num_rows, query_block, BLOCK_Q)
    is_real = row < num_rows
    q_start = tl.load(qsl_ptr + row).to(tl.int32)
    q_end = tl.load(qsl_ptr + row + 1, mask=is_real, other=num_tokens).to(tl.int32)
    ctx = tl.load(seq_lens_ptr + row, mask=is_real, other=0).to(tl.int32)
    q_len = q_end - q_start
    first_tok = (query_block - (q_start // BLOCK_Q + row)) * BLOCK_Q

    if first_tok < q_len:
        offs_m = tl.arange(0, BLOCK_M)
        tok = first_tok + offs_m // HEAD_BLOCK
        head = head_block * HEAD_BLOCK + offs_m % HEAD_BLOCK
        row_ok = (offs_m // HEAD_BLOCK < BLOCK_Q) & (tok < q_len) & (head < NUM_HEADS)
        token = (q_start + tok).to(tl.int64)
        q_pos = ctx - q_len + tok
        dims = tl.arange(0, RANK_PAD)
        dims_ok = dims < RANK
        pe_dims = tl.arange(0, ROPE_PAD)
        pe_ok = pe_dims < ROPE

        q = tl.load(
            q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
            mask=row_ok[:, None] & dims_ok[None, :],
            other=0.0,
        )
        q_pe = tl.load(
            q_pe_ptr + token[:, None] * stride_pt + head[:, None] * stride_ph + pe_dims[None, :],
            mask=row_ok[:, None] & pe_ok[None, :],
            other=0.0,
        ).to(q.dtype)

        # Keys up to the block's last query position (causal); none for padding rows.
        last_tok = tl.minimum(first_tok + BLOCK_Q, q_len) - 1
        kv_end = tl.maximum(ctx - q_len + last_tok + 1, 0)
        num_tiles = (kv_end + TILE - 1) // TILE

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, RANK_PAD], dtype=tl.float32)
        table_row = block_tables_ptr + row.to(tl.int64) * stride_bt
        for t in range(0, num_tiles):
            k_idx = t * TILE + tl.arange(0, TILE)
            k_ok = k_idx < kv_end
            page = tl.load(table_row + k_idx // PAGE, mask=k_ok, other=0).to(tl.int64)
            k_row = cache_ptr + page * stride_cb + (k_idx % PAGE) * stride_co
            # The tile's c, loaded once: key (transposed) for the scores, value for P @ V.
            c = tl.load(
                k_row[:, None] + dims[None, :],
                mask=k_ok[:, None] & dims_ok[None, :],
                other=0.0,
            )
            k_pe = tl.load(
                k_row[:, None] + RANK + pe_dims[None, :],
                mask=k_ok[:, None] & pe_ok[None, :],
                other=0.0,
            )
            # Inline under the kernel's own constexpr: Triton 3.6 compiles both returns of
            # a helper's constexpr branch and refuses their different types.
            if KV_FP8:  # to q's dtype, exactly (every e4m3 value is a half / float32 value)
                c = c.to(tl.float32).to(q.dtype)
                k_pe = k_pe.to(tl.float32).to(q.dtype)
            s = _dot(q, tl.trans(c), DOT_PRECISION, DOT_INTERPRETED)
            s += _dot(q_pe, tl.trans(k_pe), DOT_PRECISION, DOT_INTERPRETED)
            s = s * scale_log2
            visible = k_ok[None, :] & (k_idx[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with nothing visible yet keeps m = -inf; shift by 0 to avoid inf - inf.
            m_shift = tl.where(m_new > float("-inf"), m_new, 0.0)
            p = tl.exp2(s - m_shift[:, None])
            alpha = tl.exp2(m_i - m_shift)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _dot(p.to(c.dtype), c, DOT_PRECISION, DOT_INTERPRETED)
            m_i = m_new

        has_keys = l_i > 0.0
        l_safe = tl.where(has_keys, l_i, 1.0)
        out = acc / l_safe[:, None]
        if KV_FP8:
            out = out * out_scale
        lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(
            out_ptrs + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dims_ok[None, :],
        )
        tl.store(lse_ptr + token * stride_lt + head * stride_lh, lse, mask=row_ok)


def mla_plan(num_heads: int, dtype: torch.dtype) -> dict:
    """The one plan for every row of a model's MLA layers (its shape only, never the batch).

    HEAD_BLOCK heads per program (see the module docstring), packed with BLOCK_Q tokens
    into BLOCK_M >= 16 dot rows. TILE keys per step: a bfloat16 tile of Kimi's rows is
    32 x 576 x 2 = 36 KiB of shared memory. Compiled for sm_90 offline (Triton 3.6 and
    3.9, no GPU), 8 warps hold the [16, 512] float32 accumulator in 105 registers a
    thread, 173 over an FP8 cache, with no spills; 4 warps need 194 to 255 and spill
    over FP8, and 64-key tiles spill too. float32 (tests) takes 16-key tiles and 4 warps,
    its spill-free setting. r and dr are padded each to its own power of two >= 16
    (RANK_PAD / ROPE_PAD, set at launch), so they do not change the plan.
    """
    head_block = min(num_heads, HEAD_BLOCK)
    block_m = max(16, next_power_of_2(head_block))
    wide = dtype == torch.float32
    return {
        "HEAD_BLOCK": head_block,
        "BLOCK_M": block_m,
        "BLOCK_Q": block_m // head_block,
        "TILE": 16 if wide else 32,
        "num_warps": 4 if wide else 8,
        "num_stages": 2,
    }


def _check_plan(plan: dict) -> None:
    head_block, block_m, block_q = plan["HEAD_BLOCK"], plan["BLOCK_M"], plan["BLOCK_Q"]
    tile = plan["TILE"]
    pow2 = all(n >= 16 and n == next_power_of_2(n) for n in (block_m, tile))
    if not (pow2 and head_block >= 1 and block_q >= 1 and head_block * block_q <= block_m):
        raise ValueError(f"plan: invalid {plan}")


def _check_args(q_latent, q_pe, latent_cache, block_tables, query_start_loc, seq_lens):
    if q_latent.dim() != 3:
        raise ValueError(f"q_latent: expected [T, H, r], got shape {tuple(q_latent.shape)}")
    num_tokens, num_heads, rank = q_latent.shape
    if q_pe.dim() != 3 or tuple(q_pe.shape[:2]) != (num_tokens, num_heads):
        raise ValueError(
            f"q_pe: expected [{num_tokens}, {num_heads}, dr], got shape {tuple(q_pe.shape)}"
        )
    width = rank + q_pe.shape[2]
    if latent_cache.dim() != 3 or latent_cache.shape[2] != width:
        raise ValueError(
            f"latent_cache: expected [blocks, block_size, {width}], got {tuple(latent_cache.shape)}"
        )
    check_dtype("q_latent", q_latent)
    check_dtype("q_pe", q_pe)
    if latent_cache.dtype != q_latent.dtype and not is_fp8(latent_cache.dtype):
        raise ValueError(
            f"latent_cache: dtype {latent_cache.dtype} is neither q_latent's "
            f"{q_latent.dtype} nor float8_e4m3fn"
        )
    check_paging_args(block_tables, query_start_loc, seq_lens)
    check_last_dim_contiguous("q_latent", q_latent)
    check_last_dim_contiguous("q_pe", q_pe)
    check_last_dim_contiguous("latent_cache", latent_cache)
    check_same_device(
        q_latent=q_latent,
        q_pe=q_pe,
        latent_cache=latent_cache,
        block_tables=block_tables,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
    )


def mla_attention_triton(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_scale: float = 1.0,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    _plan_override: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_latent [T, H, r] (W_UK absorbed), q_pe [T, H, dr], latent_cache [blocks,
    block_size, r + dr]; returns (o_latent [T, H, r] in q_latent's dtype, lse [T, H]
    float32, natural log). `kv_scale`: an FP8 cache's per-tensor scale (unused
    otherwise). `out` / `lse` may be given to write into. No host sync. Rows must not
    need more pages than `block_tables` has columns. `_plan_override`: tests only."""
    _check_args(q_latent, q_pe, latent_cache, block_tables, query_start_loc, seq_lens)
    check_scale("kv_scale", kv_scale)
    num_tokens, num_heads, rank = q_latent.shape
    rope = q_pe.shape[2]
    if out is None:
        out = torch.empty_like(q_latent, memory_format=torch.contiguous_format)
    if out.shape != q_latent.shape or out.dtype != q_latent.dtype:
        raise ValueError(
            f"out: expected {q_latent.dtype} of shape {tuple(q_latent.shape)}, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    check_last_dim_contiguous("out", out)
    if lse is None:
        lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=q_latent.device)
    if lse.shape != (num_tokens, num_heads) or lse.dtype != torch.float32:
        raise ValueError(
            f"lse: expected float32 of shape ({num_tokens}, {num_heads}), "
            f"got {lse.dtype} {tuple(lse.shape)}"
        )
    check_same_device(q_latent=q_latent, out=out, lse=lse)
    if num_tokens == 0 or num_heads == 0:
        return out, lse
    plan = _plan_override or mla_plan(num_heads, q_latent.dtype)
    _check_plan(plan)
    fp8 = is_fp8(latent_cache.dtype)
    num_rows = seq_lens.shape[0]
    num_head_blocks = -(-num_heads // plan["HEAD_BLOCK"])
    grid = ((num_tokens // plan["BLOCK_Q"] + num_rows + 1) * num_head_blocks,)
    _mla_attention_kernel[grid](
        q_latent,
        q_pe,
        latent_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        lse,
        float(scale) * LOG2E * (kv_scale if fp8 else 1.0),
        float(kv_scale),
        num_rows,
        num_tokens,
        q_latent.stride(0),
        q_latent.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        latent_cache.stride(0),
        latent_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        lse.stride(1),
        NUM_HEADS=num_heads,
        NUM_HEAD_BLOCKS=num_head_blocks,
        HEAD_BLOCK=plan["HEAD_BLOCK"],
        RANK=rank,
        RANK_PAD=max(16, next_power_of_2(rank)),
        ROPE=rope,
        ROPE_PAD=max(16, next_power_of_2(rope)),
        BLOCK_M=plan["BLOCK_M"],
        BLOCK_Q=plan["BLOCK_Q"],
        TILE=plan["TILE"],
        PAGE=latent_cache.shape[1],
        DOT_PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32",
        DOT_INTERPRETED=is_interpreted(_mla_attention_kernel),
        KV_FP8=fp8,
        num_warps=plan["num_warps"],
        num_stages=plan["num_stages"],
    )
    return out, lse
