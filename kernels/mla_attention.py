"""Multi-head latent attention (MLA) over a paged latent cache: the pure-torch reference.

MLA (DeepSeek-V2/V3, Kimi-Linear) caches per token one compressed latent c [r] (after the
kv_a layernorm) and one key part shared by all heads, k_pe [dr] (rotated or not: Kimi-Linear
is NoPE and caches it as projected). Head h's key and value are decompressed from the latent,
k_h = [W_UK[h] c, k_pe] and v_h = W_UV[h] c, with W_UK / W_UV the two halves of kv_b_proj.

This kernel works in the *absorbed* form: the caller folds W_UK into the query
(q_latent[h] = W_UK[h]^T q_nope[h]) and W_UV into the output (o[h] = W_UV[h] o_latent[h]), so

    score(h, t, s) = scale * (q_latent[h, t] . c_s + q_pe[h, t] . k_pe_s)
    o_latent[h, t] = sum_s softmax_s(score) c_s

which is exactly the decompressed attention, rearranged. The cache row [c_s | k_pe_s] is then
the one key every head reads and c_s the one value: multi-query attention with key width
r + dr and value width r, and nothing is decompressed per cached token. One call serves any
mix of prefill chunks and decode rows, with the layout conventions of `paged_attention.py`:
row i owns queries q[query_start_loc[i]:query_start_loc[i+1]], the last tokens of a context of
seq_lens[i] tokens already written to the cache.

Cache layout: `latent_cache[block, offset_in_block, r + dr]` ([c | k_pe]). An FP8 cache
(float8_e4m3fn, `kv_cache_dtype="fp8"`) holds the row divided by one per-tensor `kv_scale`
(the layer's k_scale: the row is both key and value), multiplied back when read.
"""

from __future__ import annotations

import torch

from kvloom.kernels.kv_cache_write import dequantize_kv, quantize_kv
from kvloom.kernels.paged_attention import attention_over_context, compute_dtype


def _check(field: str, ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {message}")


def write_mla_cache_ref(
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: float = 1.0,
) -> None:
    """latent [T, r], k_pe [T, dr] -> the cache rows at slot = block * block_size + offset;
    slot < 0 is padding (not written)."""
    rank = latent.shape[-1]
    _check("latent", latent.dim() == 2, f"expected [T, r], got {list(latent.shape)}")
    _check("k_pe", k_pe.shape[0] == latent.shape[0], f"expected {latent.shape[0]} rows")
    _check(
        "latent_cache",
        latent_cache.dim() == 3 and latent_cache.shape[-1] == rank + k_pe.shape[-1],
        f"expected [blocks, block_size, {rank + k_pe.shape[-1]}], got {list(latent_cache.shape)}",
    )
    block_size = latent_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    row = torch.cat([latent[valid], k_pe[valid]], dim=-1)
    latent_cache[blocks, offsets] = quantize_kv(row, latent_cache.dtype, kv_scale)


def mla_attention_ref(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_latent [T, H, r] (W_UK already absorbed), q_pe [T, H, dr]; returns
    (o_latent [T, H, r] in q_latent's dtype, lse [T, H] float32, natural log).

    Computation runs in float32 (float64 for float64 input). Only cache positions below each
    row's context length are read, so unused slots of its last block (or NaN under the
    sanitizer) never reach the result; rows with no queries, and tokens past the last row
    (graph padding), are skipped.
    """
    _check("q_latent", q_latent.dim() == 3, f"expected [T, H, r], got {list(q_latent.shape)}")
    num_tokens, num_heads, rank = q_latent.shape
    _check(
        "q_pe",
        q_pe.dim() == 3 and tuple(q_pe.shape[:2]) == (num_tokens, num_heads),
        f"expected [{num_tokens}, {num_heads}, dr], got {list(q_pe.shape)}",
    )
    width = rank + q_pe.shape[-1]
    _check(
        "latent_cache",
        latent_cache.dim() == 3 and latent_cache.shape[-1] == width,
        f"expected [blocks, block_size, {width}], got {list(latent_cache.shape)}",
    )
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    _check("query_start_loc", len(starts) == len(lens) + 1, "expected one more entry than rows")
    # Tokens past the last row are a CUDA graph's padding: they get zeros (lse -inf).
    _check("query_start_loc", starts[-1] <= num_tokens, f"must end at or below {num_tokens}")
    block_size = latent_cache.shape[1]
    query = torch.cat([q_latent, q_pe.to(q_latent.dtype)], dim=-1)
    out = torch.zeros_like(q_latent)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32)
    lse = lse.to(q_latent.device)
    for row, context_len in enumerate(lens):
        start, end = starts[row], starts[row + 1]
        if end == start:
            continue
        _check("seq_lens", context_len >= end - start, f"row {row} has fewer keys than queries")
        blocks = block_tables[row, : -(-context_len // block_size)].long()
        keys = latent_cache[blocks].flatten(0, 1)[:context_len].unsqueeze(1)  # [m, 1, r + dr]
        keys = dequantize_kv(keys, compute_dtype(q_latent.dtype), kv_scale)
        q_pos = torch.arange(context_len - (end - start), context_len, device=q_latent.device)
        k_pos = torch.arange(context_len, device=q_latent.device)
        o, row_lse = attention_over_context(
            query[start:end], keys, keys[..., :rank], q_pos, k_pos, scale
        )
        out[start:end] = o.to(out.dtype)
        lse[start:end] = row_lse.float()
    return out, lse
