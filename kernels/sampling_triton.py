"""Top-k / top-p filtering of logits into probabilities: the Triton kernels.

Same semantics as `sampling.top_k_top_p_probs_ref` (read its docstring), without a sort.
Each row is cut into fixed segments of SEGMENT tokens, one program per (row, segment), so
a single row still spreads over the GPU. Both cut-offs are found by radix selection,
RADIX_BITS bits of the cut-off per launch, most significant first:
- top-k: the k-th largest logit, as the largest key K with count(key >= K) >= k, where
  the key maps float32 order onto unsigned integer order;
- top-p: the smallest kept probability, as the largest value t held by some token with
  mass(prob >= t) >= p (the bits of a non-negative float are ordered like the float).
A launch histograms its segment's keys that match the digits chosen so far; the next
launch's programs each fold all of the row's histograms into the next digit (the same
arithmetic in every program, so they agree) and the segment-0 program records it.
Counting is exact, so the top-k set equals the reference's; masses are float32 sums in
another order than the reference's cumulative sum, so the top-p set can differ only where
the cumulative probability meets p within rounding. Segments depend on the vocab only,
so a row's result does not depend on the batch. Launches: 2 without filters; with both
filters 4 + 2 * 32 / RADIX_BITS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.kernels.sampling import check_logits, per_row_top_k, per_row_top_p

BLOCK_V = 512  # tokens a program handles at once
SEGMENT = 2048  # tokens per program (a multiple of BLOCK_V)
RADIX_BITS = 2  # bits of a cut-off fixed per launch (1, 2, 4 or 8); 2 measured best
FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)  # jit code reads only constexpr globals


@triton.jit
def _load_row(row_ptr, offs, vocab, flat):
    """Sanitised float32 logits: NaN -> -inf, +inf -> max finite, -0 -> +0; lanes past
    the vocab are -inf; a row with no finite logit (`flat`) reads as all zeros."""
    valid = offs < vocab
    x = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("-inf"), x)
    x = tl.minimum(x, FLOAT32_MAX)
    x = tl.where(x == 0.0, 0.0, x)
    return tl.where(valid, tl.where(flat, 0.0, x), x)


@triton.jit
def _ordered_key(x):
    """float32 -> uint32 with the same order (after -0 -> +0): flip the sign bit of
    non-negative floats, every bit of negative ones. 32-bit keys keep the per-token work
    off 64-bit integer arithmetic."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits ^ -2147483648, ~bits).to(tl.uint32, bitcast=True)


@triton.jit
def _prob(x, key, k_key, row_max, denom):
    """Probability after the top-k cut (0 for cut tokens); the same bits in every pass."""
    return tl.where(key >= k_key.to(tl.uint32), tl.exp(x - row_max) / denom, 0.0)


@triton.jit
def _row_stats(stats_ptr, row, num_segs, vocab, SEGS_PAD: tl.constexpr):
    """Row max, 'no finite logit' flag and softmax denominator from the segments' stats."""
    segs = tl.arange(0, SEGS_PAD)
    ok = segs < num_segs
    base = stats_ptr + (row * num_segs + segs) * 2
    seg_max = tl.load(base, mask=ok, other=float("-inf"))
    seg_sum = tl.load(base + 1, mask=ok, other=0.0)
    row_max = tl.max(seg_max, 0)
    flat = row_max == float("-inf")
    row_max = tl.where(flat, 0.0, row_max)
    denom = tl.sum(tl.where(ok, seg_sum * tl.exp(seg_max - row_max), 0.0), 0)
    return row_max, flat, tl.where(flat, vocab * 1.0, denom)  # vocab may be a constexpr 1


@triton.jit
def _sum_segments(part_ptr, row, num_segs, SEGS_PAD: tl.constexpr):
    segs = tl.arange(0, SEGS_PAD)
    return tl.sum(tl.load(part_ptr + row * num_segs + segs, mask=segs < num_segs, other=0.0), 0)


@triton.jit
def _decide(
    hist_ptr,
    row,
    num_rows,
    num_segs,
    parity,
    prefix,
    above,
    target,
    BY_MASS: tl.constexpr,
    BITS: tl.constexpr,
    SEGS_PAD: tl.constexpr,
):
    """Folds one launch's histograms into the next digit: the largest digit d held by some
    token with above + weight(digit >= d) >= target, else (a mass just under target after
    rounding) the smallest held digit, so everything stays. `above` is the weight of keys
    already known to be larger than the cut-off."""
    digits = tl.arange(0, 1 << BITS)
    segs = tl.arange(0, SEGS_PAD)
    rows_base = ((parity * num_rows + row) * num_segs + segs) * 2
    ptrs = hist_ptr + rows_base[:, None] * (1 << BITS) + digits[None, :]
    seg_ok = (segs < num_segs)[:, None]
    count = tl.sum(tl.load(ptrs, mask=seg_ok, other=0.0), 0)
    mass = count
    if BY_MASS:
        mass = tl.sum(tl.load(ptrs + (1 << BITS), mask=seg_ok, other=0.0), 0)
    # suffix[d]: weight of the keys under this prefix whose digit is >= d
    suffix = tl.sum(tl.where(digits[None, :] >= digits[:, None], mass[None, :], 0.0), 1)
    present = count > 0.0
    ok = present & (above + suffix >= target)
    any_ok = tl.max(ok.to(tl.int32), 0) > 0
    best = tl.max(tl.where(ok, digits, -1), 0)
    lowest = tl.min(tl.where(present, digits, 1 << BITS), 0)
    chosen = tl.where(any_ok, best, lowest)
    above = above + tl.sum(tl.where(digits > chosen, mass, 0.0), 0)
    return prefix * (1 << BITS) + chosen.to(tl.int64), above


@triton.jit
def _final_cut(
    hist_ptr,
    prefix_ptr,
    above_ptr,
    row,
    num_rows,
    num_segs,
    target,
    BY_MASS: tl.constexpr,
    BITS: tl.constexpr,
    SEGS_PAD: tl.constexpr,
):
    """The cut-off key, from the last launch's state and histograms."""
    last = 32 // BITS - 1
    prefix = tl.load(prefix_ptr + last * num_rows + row)
    above = tl.load(above_ptr + last * num_rows + row)
    key, above = _decide(
        hist_ptr,
        row,
        num_rows,
        num_segs,
        last % 2,
        prefix,
        above,
        target,
        BY_MASS,
        BITS,
        SEGS_PAD,
    )
    return key


@triton.jit
def _keys_and_weights(x, offs, vocab, k_key, row_max, denom, BY_MASS: tl.constexpr):
    """Per lane: the key a select orders by and the weight it sums (count or mass)."""
    key = _ordered_key(x)
    weight = tl.where(offs < vocab, 1.0, 0.0)
    if BY_MASS:
        weight = _prob(x, key, k_key, row_max, denom)
        key = weight.to(tl.uint32, bitcast=True)
    return key, weight


@triton.jit
def _stats_kernel(logits_ptr, stats_ptr, stride_l, vocab, SEG: tl.constexpr, BLOCK: tl.constexpr):
    """Per (row, segment): online max and sum of exponentials of the sanitised logits."""
    row = tl.program_id(0)
    seg = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_l
    no = tl.zeros([], dtype=tl.int1)
    lane_max = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    lane_sum = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, SEG, BLOCK):
        offs = seg * SEG + start + tl.arange(0, BLOCK)
        x = _load_row(row_ptr, offs, vocab, no)
        new_max = tl.maximum(lane_max, x)
        shift = tl.where(new_max > float("-inf"), new_max, 0.0)
        lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(x - shift)
        lane_max = new_max
    seg_max = tl.max(lane_max, 0)
    shift = tl.where(seg_max > float("-inf"), seg_max, 0.0)
    seg_sum = tl.sum(lane_sum * tl.exp(lane_max - shift), 0)
    out = stats_ptr + (row * tl.num_programs(1) + seg) * 2
    tl.store(out, seg_max)
    tl.store(out + 1, seg_sum)


@triton.jit(do_not_specialize=["pass_idx", "num_rows"])
def _select_pass_kernel(
    logits_ptr,
    stats_ptr,
    top_k_ptr,
    top_p_ptr,
    k_key_ptr,
    denom_part_ptr,
    hist_ptr,
    prefix_ptr,
    above_ptr,
    stride_l,
    vocab,
    num_rows,
    pass_idx,
    BY_MASS: tl.constexpr,
    HAS_TOP_K: tl.constexpr,
    SEG: tl.constexpr,
    BLOCK: tl.constexpr,
    BITS: tl.constexpr,
    SEGS_PAD: tl.constexpr,
):
    """One radix launch: fold the previous launch's histograms into the digits chosen so
    far, then histogram this segment's keys under that prefix by their next digit."""
    row = tl.program_id(0)
    seg = tl.program_id(1)
    num_segs = tl.num_programs(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_l
    row_max, flat, denom = _row_stats(stats_ptr, row, num_segs, vocab, SEGS_PAD)
    k_key = tl.zeros([], dtype=tl.int64)
    if BY_MASS:
        target = tl.load(top_p_ptr + row).to(tl.float32)
        active = target < 1.0
        if HAS_TOP_K:
            k_key = tl.load(k_key_ptr + row)
            denom = _sum_segments(denom_part_ptr, row, num_segs, SEGS_PAD)
    else:
        k = tl.load(top_k_ptr + row)
        active = (k > 0) & (k < vocab)
        target = k.to(tl.float32)
    if active:
        prefix = tl.zeros([], dtype=tl.int64)
        above = tl.zeros([], dtype=tl.float32)
        if pass_idx > 0:
            prev = (pass_idx - 1) * num_rows + row
            prefix, above = _decide(
                hist_ptr,
                row,
                num_rows,
                num_segs,
                (pass_idx - 1) % 2,
                tl.load(prefix_ptr + prev),
                tl.load(above_ptr + prev),
                target,
                BY_MASS,
                BITS,
                SEGS_PAD,
            )
        if seg == 0:
            tl.store(prefix_ptr + pass_idx * num_rows + row, prefix)
            tl.store(above_ptr + pass_idx * num_rows + row, above)
        shift = (32 - BITS * (pass_idx + 1)).to(tl.uint32)
        prefix32 = prefix.to(tl.uint32)
        digits = tl.arange(0, 1 << BITS)
        counts = tl.zeros([BLOCK, 1 << BITS], dtype=tl.float32)
        masses = tl.zeros([BLOCK, 1 << BITS], dtype=tl.float32)
        for start in range(0, SEG, BLOCK):
            offs = seg * SEG + start + tl.arange(0, BLOCK)
            x = _load_row(row_ptr, offs, vocab, flat)
            key, weight = _keys_and_weights(x, offs, vocab, k_key, row_max, denom, BY_MASS)
            # two shifts: a 32-bit shift by 32 (the first launch) is undefined
            match = (((key >> (shift + (BITS - 1))) >> 1) == prefix32) & (offs < vocab)
            digit = ((key >> shift) & ((1 << BITS) - 1)).to(tl.int32)
            hit = match[:, None] & (digit[:, None] == digits[None, :])
            counts += hit.to(tl.float32)
            if BY_MASS:
                masses += tl.where(hit, weight[:, None], 0.0)
        out = hist_ptr + (((pass_idx % 2) * num_rows + row) * num_segs + seg) * 2 * (1 << BITS)
        tl.store(out + digits, tl.sum(counts, 0))
        if BY_MASS:
            tl.store(out + (1 << BITS) + digits, tl.sum(masses, 0))


@triton.jit(do_not_specialize=["num_rows"])
def _cut_kernel(
    logits_ptr,
    stats_ptr,
    top_k_ptr,
    top_p_ptr,
    k_key_ptr,
    p_key_ptr,
    denom_part_ptr,
    kept_part_ptr,
    hist_ptr,
    prefix_ptr,
    above_ptr,
    stride_l,
    vocab,
    num_rows,
    BY_MASS: tl.constexpr,
    HAS_TOP_K: tl.constexpr,
    SEG: tl.constexpr,
    BLOCK: tl.constexpr,
    BITS: tl.constexpr,
    SEGS_PAD: tl.constexpr,
):
    """After a select: record the cut-off and sum, per segment, what it keeps (the
    top-k softmax denominator, or the top-p kept mass for renormalising)."""
    row = tl.program_id(0)
    seg = tl.program_id(1)
    num_segs = tl.num_programs(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_l
    row_max, flat, denom = _row_stats(stats_ptr, row, num_segs, vocab, SEGS_PAD)
    k_key = tl.zeros([], dtype=tl.int64)
    cut = tl.zeros([], dtype=tl.int64)  # every key is >= 0: nothing cut
    if BY_MASS:
        target = tl.load(top_p_ptr + row).to(tl.float32)
        active = target < 1.0
        if HAS_TOP_K:
            k_key = tl.load(k_key_ptr + row)
            denom = _sum_segments(denom_part_ptr, row, num_segs, SEGS_PAD)
    else:
        k = tl.load(top_k_ptr + row)
        active = (k > 0) & (k < vocab)
        target = k.to(tl.float32)
    if active:
        cut = _final_cut(
            hist_ptr,
            prefix_ptr,
            above_ptr,
            row,
            num_rows,
            num_segs,
            target,
            BY_MASS,
            BITS,
            SEGS_PAD,
        )
    if seg == 0:
        if BY_MASS:
            tl.store(p_key_ptr + row, cut)
        else:
            tl.store(k_key_ptr + row, cut)
    lane_sum = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, SEG, BLOCK):
        offs = seg * SEG + start + tl.arange(0, BLOCK)
        x = _load_row(row_ptr, offs, vocab, flat)
        key = _ordered_key(x)
        if BY_MASS:
            p = _prob(x, key, k_key, row_max, denom)
            keep = p.to(tl.uint32, bitcast=True) >= cut.to(tl.uint32)
            lane_sum += tl.where(keep & (offs < vocab), p, 0.0)
        else:
            keep = (key >= cut.to(tl.uint32)) & (offs < vocab)
            lane_sum += tl.where(keep, tl.exp(x - row_max), 0.0)
    if BY_MASS:
        tl.store(kept_part_ptr + row * num_segs + seg, tl.sum(lane_sum, 0))
    else:
        tl.store(denom_part_ptr + row * num_segs + seg, tl.sum(lane_sum, 0))


@triton.jit
def _write_probs_kernel(
    logits_ptr,
    probs_ptr,
    stats_ptr,
    top_p_ptr,
    k_key_ptr,
    p_key_ptr,
    denom_part_ptr,
    kept_part_ptr,
    stride_l,
    stride_p,
    vocab,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    SEG: tl.constexpr,
    BLOCK: tl.constexpr,
    SEGS_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    seg = tl.program_id(1)
    num_segs = tl.num_programs(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_l
    out_ptr = probs_ptr + row.to(tl.int64) * stride_p
    row_max, flat, denom = _row_stats(stats_ptr, row, num_segs, vocab, SEGS_PAD)
    k_key = tl.zeros([], dtype=tl.int64)
    if HAS_TOP_K:
        k_key = tl.load(k_key_ptr + row)
        denom = _sum_segments(denom_part_ptr, row, num_segs, SEGS_PAD)
    p_key = tl.zeros([], dtype=tl.int64)
    renorm = tl.full([], 1.0, dtype=tl.float32)
    if HAS_TOP_P:
        p_key = tl.load(p_key_ptr + row)
        kept = _sum_segments(kept_part_ptr, row, num_segs, SEGS_PAD)
        renorm = tl.where(tl.load(top_p_ptr + row) < 1.0, kept, 1.0)
    for start in range(0, SEG, BLOCK):
        offs = seg * SEG + start + tl.arange(0, BLOCK)
        x = _load_row(row_ptr, offs, vocab, flat)
        p = _prob(x, _ordered_key(x), k_key, row_max, denom)
        if HAS_TOP_P:
            p_bits = p.to(tl.uint32, bitcast=True)
            p = tl.where(p_bits >= p_key.to(tl.uint32), p / renorm, 0.0)
        tl.store(out_ptr + offs, p, mask=offs < vocab)


def top_k_top_p_probs_triton(
    logits: torch.Tensor,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    _block: int = BLOCK_V,
    _bits: int = RADIX_BITS,
    _segment: int = SEGMENT,
) -> torch.Tensor:
    """logits: [rows, vocab] float16/bfloat16/float32 (temperature already applied);
    returns float32 probabilities of the same shape. Per-row parameters stay on the
    device (no host sync); scratch buffers are allocated per call (fine under CUDA-graph
    capture). The underscored arguments are tuning knobs for benchmarks and tests."""
    check_logits(logits)
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"logits: dtype {logits.dtype} is not supported by the Triton kernel")
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError("logits: the vocab dim must be contiguous")
    rows, vocab = logits.shape
    ks = per_row_top_k(top_k, rows, logits.device)
    ps = per_row_top_p(top_p, rows, logits.device)
    if out is None:
        out = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    if out.shape != logits.shape or out.dtype != torch.float32 or out.device != logits.device:
        raise ValueError(
            f"out: expected float32 of shape {tuple(logits.shape)} on {logits.device}, got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if vocab > 1 and out.stride(1) != 1:
        raise ValueError("out: the vocab dim must be contiguous")
    if rows == 0:
        return out
    block = min(_block, max(16, triton.next_power_of_2(vocab)))
    # a multiple of the block, no longer than the vocab needs
    seg = max(block, min(_segment, triton.cdiv(vocab, block) * block) // block * block)
    num_segs = triton.cdiv(vocab, seg)
    segs_pad = max(2, triton.next_power_of_2(num_segs))
    if 32 % _bits:
        raise ValueError(f"_bits: must divide 32, got {_bits}")
    dev = logits.device
    f32 = dict(dtype=torch.float32, device=dev)
    stats = torch.empty((rows, num_segs, 2), **f32)
    denom_part = torch.empty((rows, num_segs), **f32) if ks is not None else stats
    kept_part = torch.empty((rows, num_segs), **f32) if ps is not None else stats
    k_key = torch.zeros((rows,), dtype=torch.int64, device=dev)
    p_key = torch.zeros((rows,), dtype=torch.int64, device=dev)
    passes = 32 // _bits
    hist = torch.empty((2, rows, num_segs, 2, 1 << _bits), **f32)
    prefix = torch.empty((passes, rows), dtype=torch.int64, device=dev)
    above = torch.empty((passes, rows), **f32)
    grid = (rows, num_segs)
    tiles = dict(SEG=seg, BLOCK=block)
    radix = dict(BITS=_bits, SEGS_PAD=segs_pad, num_warps=4)
    top_k_arg = ks if ks is not None else k_key
    top_p_arg = ps if ps is not None else stats
    _stats_kernel[grid](logits, stats, logits.stride(0), vocab, **tiles, num_warps=4)
    for by_mass, wanted in ((False, ks), (True, ps)):
        if wanted is None:
            continue
        state = (hist, prefix, above, logits.stride(0), vocab, rows)
        for pass_idx in range(passes):
            _select_pass_kernel[grid](
                logits,
                stats,
                top_k_arg,
                top_p_arg,
                k_key,
                denom_part,
                *state,
                pass_idx,
                BY_MASS=by_mass,
                HAS_TOP_K=ks is not None,
                **tiles,
                **radix,
            )
        _cut_kernel[grid](
            logits,
            stats,
            top_k_arg,
            top_p_arg,
            k_key,
            p_key,
            denom_part,
            kept_part,
            *state,
            BY_MASS=by_mass,
            HAS_TOP_K=ks is not None,
            **tiles,
            **radix,
        )
    _write_probs_kernel[grid](
        logits,
        out,
        stats,
        top_p_arg,
        k_key,
        p_key,
        denom_part,
        kept_part,
        logits.stride(0),
        out.stride(0),
        vocab,
        HAS_TOP_K=ks is not None,
        HAS_TOP_P=ps is not None,
        **tiles,
        SEGS_PAD=segs_pad,
        num_warps=4,
    )
    return out
