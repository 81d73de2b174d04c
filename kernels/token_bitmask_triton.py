"""Structured outputs' token bitmask applied to logits in one Triton launch.

Same semantics as token_bitmask.apply_token_bitmask_ref (read its rules): one program per
(mask, block of BLOCK tokens) reads the block's bitmask words and stores -inf at the
disallowed tokens of the mask's logits row; the logits are never read, so allowed values
stay bit for bit. A negative row index (a padding mask) writes nothing. No host
synchronisation, so the launch can sit in a captured CUDA graph with fixed-size buffers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.kernels.arg_checks_triton import check_dtype, check_last_dim_contiguous
from kvloom.kernels.token_bitmask import check_token_bitmask

BLOCK = 1024  # tokens per program (32 words of the mask)


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    rows_ptr,
    stride_logits,
    stride_mask,
    vocab,
    num_words,
    BLOCK: tl.constexpr,
):
    mask_index = tl.program_id(0)
    block = tl.program_id(1)
    row = tl.load(rows_ptr + mask_index)
    tokens = block * BLOCK + tl.arange(0, BLOCK)
    words = tokens // 32
    # A padding mask (row < 0) covers no token.
    in_vocab = tokens < tl.where(row >= 0, vocab, 0)
    # Past the mask's width the word reads as 0: not allowed.
    word = tl.load(
        bitmask_ptr + mask_index.to(tl.int64) * stride_mask + words,
        mask=in_vocab & (words < num_words),
        other=0,
    )
    disallowed = ((word >> (tokens % 32)) & 1) == 0
    row_ptr = logits_ptr + tl.maximum(row, 0).to(tl.int64) * stride_logits
    minus_inf = tl.full((BLOCK,), float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(row_ptr + tokens, minus_inf, mask=in_vocab & disallowed)


def apply_token_bitmask_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None, _block=BLOCK
) -> None:
    check_token_bitmask(logits, bitmask, rows)
    check_dtype("logits", logits)
    check_last_dim_contiguous("logits", logits)
    check_last_dim_contiguous("bitmask", bitmask)
    num_masks = bitmask.shape[0]
    if num_masks == 0 or logits.shape[1] == 0:
        return
    if rows is None:
        rows = torch.arange(num_masks, device=logits.device)
    vocab = logits.shape[1]
    grid = (num_masks, triton.cdiv(vocab, _block))
    _apply_token_bitmask_kernel[grid](
        logits,
        bitmask,
        rows,
        logits.stride(0),
        bitmask.stride(0),
        vocab,
        bitmask.shape[1],
        BLOCK=_block,
    )
