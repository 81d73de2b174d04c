"""NaN-safe greedy token choice in two Triton launches (one for vocabs up to a segment).

Same result, bit for bit, as `greedy_argmax.greedy_argmax_ref` (read its rules), without
the float32 copy and the ~10 full-size temporaries of sanitize-then-argmax.

The four rules collapse into one: with NaN read as -inf, the answer is the FIRST index of
the row's maximum. A +inf, when present, is that maximum, so its first index is rule 2's
answer; a row of only -inf has its maximum (-inf) first at index 0, rule 3's answer. The
kernels only compare values (no arithmetic), so the result is exact in every dtype.

Pass 1, one program per (row, segment of SEGMENT tokens): each lane keeps the best value
it has seen and where, replacing it only on a strictly larger value, so a lane keeps the
first index of its own maximum; the segment's answer is its maximum and the smallest lane
index holding it. A segment with nothing above -inf reports NO_INDEX. Pass 2, one program
per row, folds the row's segments the same way (segment answers come in index order), and
maps NO_INDEX (a row of only -inf/NaN) to token 0. When the row fits one segment, pass 1
writes the final answer itself and pass 2 is skipped.

Segments depend on the vocab only, never on the batch, so a row's answer never depends on
its neighbours; a single decode row still spreads over ~V / SEGMENT programs. No host
synchronisation: the launches are CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.kernels.arg_checks_triton import check_dtype, check_last_dim_contiguous, next_power_of_2
from kvloom.kernels.greedy_argmax import check_greedy_logits

SEGMENT = 4096  # tokens per pass-1 program (a power of two); Qwen's 151,936 -> 38 segments
BLOCK = 1024  # tokens a pass-1 program loads at once
FOLD_BLOCK = 64  # segment answers a pass-2 program reads at once
NO_INDEX = tl.constexpr(2**31 - 1)  # "nothing above -inf here"; jit code reads constexprs


@triton.jit
def _first_max(best, index):
    """(max of best, smallest `index` holding it); NO_INDEX stays where nothing beat -inf."""
    top = tl.max(best, axis=0)
    return top, tl.min(tl.where(best == top, index, NO_INDEX), axis=0)


@triton.jit
def _segment_kernel(
    logits_ptr,
    seg_val_ptr,
    seg_idx_ptr,
    out_ptr,
    stride_row,
    vocab,
    num_segs,
    SEG: tl.constexpr,
    BLOCK: tl.constexpr,
    FINAL: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // num_segs
    seg = pid % num_segs
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    index = tl.full((BLOCK,), NO_INDEX, tl.int32)
    for start in tl.static_range(0, SEG, BLOCK):
        offs = seg * SEG + start + lanes
        x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        # Strictly larger only: NaN compares false (never wins) and a lane keeps its first
        # index on ties.
        better = x > best
        best = tl.where(better, x, best)
        index = tl.where(better, offs, index)
    top, first = _first_max(best, index)
    if FINAL:  # the row is this one segment
        tl.store(out_ptr + row, tl.where(first == NO_INDEX, 0, first).to(tl.int64))
    else:
        tl.store(seg_val_ptr + pid, top)
        tl.store(seg_idx_ptr + pid, first)


@triton.jit
def _fold_kernel(seg_val_ptr, seg_idx_ptr, out_ptr, num_segs, FOLD: tl.constexpr):
    row = tl.program_id(0)
    base = row.to(tl.int64) * num_segs
    lanes = tl.arange(0, FOLD)
    best = tl.full((FOLD,), float("-inf"), tl.float32)
    index = tl.full((FOLD,), NO_INDEX, tl.int32)
    for start in range(0, num_segs, FOLD):
        segs = start + lanes
        valid = segs < num_segs
        val = tl.load(seg_val_ptr + base + segs, mask=valid, other=float("-inf"))
        idx = tl.load(seg_idx_ptr + base + segs, mask=valid, other=NO_INDEX)
        better = val > best  # later segments hold later tokens: keep the earlier on ties
        best = tl.where(better, val, best)
        index = tl.where(better, idx, index)
    _, first = _first_max(best, index)
    tl.store(out_ptr + row, tl.where(first == NO_INDEX, 0, first).to(tl.int64))


def greedy_argmax_triton(
    logits: torch.Tensor, *, _segment: int | None = None, _block: int | None = None
) -> torch.Tensor:
    """logits [rows, vocab] (float32/bfloat16/float16, any row stride, unit column stride)
    -> chosen token ids [rows] (int64, same device).

    `_segment` / `_block` (powers of two) replace SEGMENT / BLOCK; tests use them to cover
    many segments at small vocabs in the CPU interpreter.
    """
    check_greedy_logits(logits)
    check_dtype("logits", logits)
    check_last_dim_contiguous("logits", logits)
    rows, vocab = logits.shape
    if vocab >= NO_INDEX.value:
        raise ValueError(f"logits: vocab {vocab} does not fit the kernel's int32 indices")
    segment, block = _segment or SEGMENT, _block or BLOCK
    for name, value in (("_segment", segment), ("_block", block)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name}: must be a power of two, got {value}")
    # A vocab smaller than a segment shrinks it (a function of V alone, so still batch-free).
    segment = min(segment, next_power_of_2(vocab))
    block = min(block, segment)
    num_segs = triton.cdiv(vocab, segment)

    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    final = num_segs == 1
    if final:  # pass 1 writes the answer; the segment buffers are never touched
        seg_val, seg_idx = out, out
    else:
        seg_val = torch.empty(rows * num_segs, dtype=torch.float32, device=logits.device)
        seg_idx = torch.empty(rows * num_segs, dtype=torch.int32, device=logits.device)
    _segment_kernel[(rows * num_segs,)](
        logits,
        seg_val,
        seg_idx,
        out,
        logits.stride(0),
        vocab,
        num_segs,
        SEG=segment,
        BLOCK=block,
        FINAL=final,
        num_warps=max(1, min(4, block // 256)),
    )
    if not final:
        _fold_kernel[(rows,)](
            seg_val, seg_idx, out, num_segs, FOLD=min(FOLD_BLOCK, next_power_of_2(num_segs))
        )
    return out
