"""Exact merge of attention outputs over disjoint key sets by log-sum-exp: the Triton kernel.

Same semantics as `merge_attention_states.merge_attention_states_ref`: the merged lse is
logsumexp over the parts, each part weighs exp(lse_p - lse); parts with lse = -inf add
nothing and a row with no keys anywhere gets output 0 and lse -inf. Arithmetic is float32.

One program merges one (token, head): it reads every part's row before it writes, so the
output may alias an input (`out=outputs[0]`, `out_lse=lses[0]`, as a DCP merge into the
local result does). The output may have another dtype than the parts (float32 partials
merged straight into a bfloat16 output). `merge_parts` is the merge itself, shared with the
split-KV decode's merge (paged_attention_triton), so both sum in the same order;
`merge_part_rows` is the same merge for a tile of rows (the split decode merging in its
attention launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.kernels.arg_checks_triton import (
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
    next_power_of_2,
)


@triton.jit
def merge_parts(
    lse_base,
    part_base,
    stride_lp,
    stride_pp,
    first,
    last,
    dims,
    dim_mask,
    DIM_PAD: tl.constexpr,
):
    """Merges parts first..last-1 of one (token, head), in that order: returns (output,
    lse) in float32. A part with lse = -inf (no keys) is not read and changes nothing:
    the max ignores it and it adds exactly 0 to the sum. No parts with keys: output 0,
    lse -inf (never (-inf) - (-inf))."""
    top = float("-inf")
    for p in range(first, last):
        top = tl.maximum(top, tl.load(lse_base + p * stride_lp).to(tl.float32))
    finite = top > float("-inf")
    shift = tl.where(finite, top, 0.0)
    total = 0.0
    acc = tl.zeros([DIM_PAD], dtype=tl.float32)
    for p in range(first, last):
        lse = tl.load(lse_base + p * stride_lp).to(tl.float32)
        weight = tl.exp(lse - shift)
        total += weight
        # A part without keys (weight 0) is not read: its output may be garbage.
        if weight > 0.0:
            part = tl.load(part_base + p * stride_pp + dims, mask=dim_mask, other=0.0)
            acc += weight * part.to(tl.float32)
    total = tl.where(finite, total, 1.0)  # no keys anywhere: acc is 0
    merged_lse = tl.where(finite, shift + tl.log(total), float("-inf"))
    return acc / total, merged_lse


@triton.jit
def merge_part_rows(
    lse_ptrs,
    part_ptrs,
    stride_lp,
    stride_pp,
    first,
    last,
    row_mask,
    dim_mask,
    BLOCK_M: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    """`merge_parts` for BLOCK_M (token, head) rows at once: lse_ptrs [BLOCK_M] and
    part_ptrs [BLOCK_M, DIM_PAD] point at part `first` of each row. Every element takes
    merge_parts' operations in its order (a part whose weight is 0 leaves the sum as it
    was, unread), so each row's result is merge_parts' bit for bit. Rows outside row_mask
    are not read."""
    top = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for p in range(first, last):
        lse = tl.load(lse_ptrs + p * stride_lp, mask=row_mask, other=float("-inf"))
        top = tl.maximum(top, lse.to(tl.float32))
    finite = top > float("-inf")
    shift = tl.where(finite, top, 0.0)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    for p in range(first, last):
        lse = tl.load(lse_ptrs + p * stride_lp, mask=row_mask, other=float("-inf"))
        weight = tl.exp(lse.to(tl.float32) - shift)
        total += weight
        read = (weight > 0.0)[:, None] & dim_mask[None, :]
        part = tl.load(part_ptrs + p * stride_pp, mask=read, other=0.0)
        acc = tl.where(read, acc + weight[:, None] * part.to(tl.float32), acc)
    total = tl.where(finite, total, 1.0)
    merged_lse = tl.where(finite, shift + tl.log(total), float("-inf"))
    return acc / total[:, None], merged_lse


@triton.jit
def _merge_attention_states_kernel(
    parts_ptr,
    lses_ptr,
    out_ptr,
    out_lse_ptr,
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
    num_parts,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    dims = tl.arange(0, DIM_PAD)
    dim_mask = dims < HEAD_DIM
    out, merged_lse = merge_parts(
        lses_ptr + token * stride_lt + head * stride_lh,
        parts_ptr + token * stride_pt + head * stride_ph,
        stride_lp,
        stride_pp,
        0,
        num_parts,
        dims,
        dim_mask,
        DIM_PAD,
    )
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out, mask=dim_mask)
    tl.store(out_lse_ptr + token * stride_olt + head * stride_olh, merged_lse)


def merge_attention_states_triton(
    outputs: torch.Tensor,
    lses: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """outputs: [P, T, H, D] partial results; lses: [P, T, H]. Returns (merged, lse).

    `merged` is in outputs' dtype unless `out` (any float dtype, [T, H, D]) is given;
    `lse` is float32 unless `out_lse` says otherwise. Either may alias part of an input.
    """
    if outputs.dim() != 4:
        raise ValueError(f"outputs: expected [P, T, H, D], got shape {tuple(outputs.shape)}")
    num_parts, num_tokens, num_heads, head_dim = outputs.shape
    if lses.shape != outputs.shape[:3]:
        raise ValueError(
            f"lses: expected shape {tuple(outputs.shape[:3])}, got {tuple(lses.shape)}"
        )
    if num_parts == 0:
        raise ValueError("outputs: needs at least one part")
    check_dtype("outputs", outputs)
    check_dtype("lses", lses)
    check_last_dim_contiguous("outputs", outputs)
    if out is None:
        out = torch.empty(outputs.shape[1:], dtype=outputs.dtype, device=outputs.device)
    if out.shape != outputs.shape[1:]:
        raise ValueError(f"out: expected shape {tuple(outputs.shape[1:])}, got {tuple(out.shape)}")
    check_dtype("out", out)
    check_last_dim_contiguous("out", out)
    if out_lse is None:
        out_lse = torch.empty(lses.shape[1:], dtype=torch.float32, device=lses.device)
    if out_lse.shape != lses.shape[1:]:
        raise ValueError(
            f"out_lse: expected shape {tuple(lses.shape[1:])}, got {tuple(out_lse.shape)}"
        )
    check_dtype("out_lse", out_lse)
    check_same_device(outputs=outputs, lses=lses, out=out, out_lse=out_lse)
    if num_tokens == 0 or num_heads == 0:
        return out, out_lse
    _merge_attention_states_kernel[(num_tokens, num_heads)](
        outputs,
        lses,
        out,
        out_lse,
        outputs.stride(0),
        outputs.stride(1),
        outputs.stride(2),
        lses.stride(0),
        lses.stride(1),
        lses.stride(2),
        out.stride(0),
        out.stride(1),
        out_lse.stride(0),
        out_lse.stride(1),
        num_parts,
        HEAD_DIM=head_dim,
        DIM_PAD=next_power_of_2(head_dim),
    )
    return out, out_lse
