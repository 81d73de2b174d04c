"""Paged attention over a block-paged KV cache: the pure-torch reference.

One call serves any mix of prefill chunks and decode rows. Row i owns the query tokens
`q[query_start_loc[i]:query_start_loc[i+1]]`, which are the *last* tokens of a context of
`seq_lens[i]` tokens whose keys and values already sit in the cache (the new tokens were
written before the call). Query token j of row i therefore has position
`seq_lens[i] - num_query_tokens_i + j` and attends causally to cache positions <= its own.

Cache layout: `kv_cache[0 or 1, block, offset_in_block, kv_head, head_dim]` (0 = key,
1 = value); the token at position p of row i lives in block `block_tables[i, p // B]` at
offset `p % B`.

An FP8 cache (float8_e4m3fn) holds keys / values divided by the per-tensor `k_scale` /
`v_scale`; they are multiplied back in the compute dtype before attention.

Returns the attention output and its log-sum-exp (natural log, float32, [tokens, q_heads])
so partial results over disjoint key sets can be merged exactly (decode context
parallelism); rows with no keys get lse = -inf and output 0.
"""

from __future__ import annotations

import torch

from kvloom.kernels.kv_cache_write import dequantize_kv


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half types accumulate in float32; float32/float64 keep their own precision."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def gather_context(
    kv_cache: torch.Tensor, block_table_row: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [context_len, kv_heads, head_dim] of one row, in position order."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-context_len // block_size)
    blocks = block_table_row[:num_blocks].long()
    keys = kv_cache[0, blocks].flatten(0, 1)[:context_len]
    values = kv_cache[1, blocks].flatten(0, 1)[:context_len]
    return keys, values


def attention_over_context(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal (optionally windowed) attention of q [n, Hq, D] over keys [m, Hkv, D].

    A key is visible when k_pos <= q_pos and, with a window W, k_pos > q_pos - W
    (the query plus its W - 1 predecessors, as Hugging Face defines the window).
    """
    acc = compute_dtype(q.dtype)
    num_q_heads, num_kv_heads = q.shape[1], keys.shape[1]
    group = num_q_heads // num_kv_heads
    k = keys.to(acc).repeat_interleave(group, dim=1)
    v = values.to(acc).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(acc), k) * scale
    visible = k_positions[None, :] <= q_positions[:, None]
    if sliding_window is not None:
        visible &= k_positions[None, :] > q_positions[:, None] - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    # Keys no query sees may be stale (NaN under the sanitizer, e.g. pages a sliding
    # window freed); zero them, or a BLAS path that computes 0 * NaN leaks NaN.
    v = v.masked_fill(~visible.any(dim=0)[:, None, None], 0.0)
    lse = torch.logsumexp(scores, dim=-1)  # [H, n]
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe_lse[..., None])
    out = torch.einsum("hqk,khd->qhd", probs, v)
    return out, lse.transpose(0, 1)


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    kv_stride: int = 1,
    kv_offset: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D]; returns (out [T, Hq, D] in q's dtype, lse [T, Hq] float32).

    Decode context parallelism: a rank that holds only the positions
    `kv_offset + i * kv_stride` stores position i-th of those at local index i (the block
    table then indexes local tokens); it attends over its share and returns the lse so the
    shares merge exactly. kv_stride = 1, kv_offset = 0 is the whole cache.
    """
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for row, context_len in enumerate(lens):
        start, end = starts[row], starts[row + 1]
        num_local = max(0, -(-(context_len - kv_offset) // kv_stride))
        if end == start or num_local == 0:
            continue
        keys, values = gather_context(kv_cache, block_tables[row], num_local)
        first_q_pos = context_len - (end - start)
        q_pos = torch.arange(first_q_pos, context_len, device=q.device)
        # Keys no query can see are sliced away, not masked: with a sliding window their
        # blocks may already be freed (NaN under the sanitizer) and 0 * NaN is NaN.
        first_k_pos = 0 if sliding_window is None else max(0, first_q_pos - sliding_window + 1)
        first_local = max(0, -(-(first_k_pos - kv_offset) // kv_stride))
        acc = compute_dtype(q.dtype)
        keys = dequantize_kv(keys[first_local:], acc, k_scale)
        values = dequantize_kv(values[first_local:], acc, v_scale)
        k_pos = kv_offset + kv_stride * torch.arange(first_local, num_local, device=q.device)
        o, row_lse = attention_over_context(
            q[start:end], keys, values, q_pos, k_pos, scale, sliding_window
        )
        out[start:end] = o.to(q.dtype)
        lse[start:end] = row_lse.float()
    return out, lse
