"""Structured outputs' token bitmask applied to logits, in place (pure-torch reference).

The mask is xgrammar's layout: int32 words, bit j of word i of a mask allows token
32 * i + j. Mask m applies to logits row `rows[m]`: every token its mask does not allow
becomes -inf, allowed tokens keep their value. Tokens past the mask's width (32 * words)
are disallowed. A negative row index is a padding mask and changes nothing, so a caller can
launch a fixed number of masks. The Triton kernel (token_bitmask_triton.py) has the same
semantics, bit for bit (it only writes -inf).
"""

from __future__ import annotations

import torch


def check_token_bitmask(logits, bitmask, rows) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError("logits: expected a 2-D floating-point tensor [rows, vocab]")
    if not isinstance(bitmask, torch.Tensor) or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError("bitmask: expected an int32 tensor [masks, words]")
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask: on {bitmask.device}, the logits are on {logits.device}")
    if rows is None:
        if bitmask.shape[0] != logits.shape[0]:
            raise ValueError(
                f"bitmask: {bitmask.shape[0]} masks for {logits.shape[0]} logits rows "
                "(pass rows= to mask some rows only)"
            )
        return
    if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.dtype != torch.int64:
        raise ValueError("rows: expected an int64 tensor [masks]")
    if rows.shape[0] != bitmask.shape[0] or rows.device != logits.device:
        raise ValueError(f"rows: one per mask ({bitmask.shape[0]}), on the logits' device")


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 words [M, W] -> bool [M, vocab] (tokens past 32 * W are not allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    pad = torch.zeros(bits.shape[0], vocab - bits.shape[1], dtype=torch.bool, device=bits.device)
    return torch.cat([bits, pad], dim=1)


def apply_token_bitmask_ref(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    check_token_bitmask(logits, bitmask, rows)
    allowed = allowed_tokens(bitmask, logits.shape[1])
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
        return
    real = rows >= 0
    index, allowed = rows[real], allowed[real]
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
