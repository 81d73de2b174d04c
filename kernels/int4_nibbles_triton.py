"""Unpacking int4 words in Triton kernels (the W4A16 GEMV, GEMM, dequantization and fused
MoE), and turning the nibbles into q = nibble - 8 without an int -> float conversion.

A word holds eight 4-bit values, value i at bits 4 * i. Unpacking with one broadcast shift
(`words[..., None] >> 4 * arange(8)`) leaves the compiler free to spread the new
dimension over threads, and it does: each thread then reads other threads' words back
from shared memory for one value each. Joins keep each new dimension in the registers of
the thread that holds the word, so a word is loaded once and unpacked where it is.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def word_nibbles(words):
    """[R, W] int32 words -> [R, W, 8] values in [0, 15], lowest nibble first, each word's
    eight in the thread that holds it."""
    n0, n1 = words & 0xF, (words >> 4) & 0xF
    n2, n3 = (words >> 8) & 0xF, (words >> 12) & 0xF
    n4, n5 = (words >> 16) & 0xF, (words >> 20) & 0xF
    n6, n7 = (words >> 24) & 0xF, (words >> 28) & 0xF
    # joined[..., i, j, k] = nibble 4i + 2j + k, so the reshape keeps the natural order.
    even = tl.join(tl.join(n0, n4), tl.join(n2, n6))  # [..., i, j] = nibble 4i + 2j
    odd = tl.join(tl.join(n1, n5), tl.join(n3, n7))  # [..., i, j] = nibble 4i + 2j + 1
    joined = tl.join(even, odd)
    return tl.reshape(joined, [joined.shape[0], joined.shape[1], 8])


@triton.jit
def nibble_q_fp32(nibbles):
    """q = nibble - 8 as float32, exactly: (2^23 + nibble) as float32 bits minus 2^23 + 8
    (no int -> float conversion, a quarter-rate instruction)."""
    return (nibbles | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def nibble_q_16bit(nibbles, DTYPE: tl.constexpr):
    """q = nibble - 8 as DTYPE (bf16 or fp16), exactly: the nibble in the low bits of 128.0
    (bf16) or 1024.0 (fp16), whose last significand bit is worth 1, minus 136 or 1032.
    Its product with a DTYPE scale, rounded once in DTYPE, is the float32 product (exact:
    at most 3 + 11 significant bits) rounded to DTYPE: the same bits with no float32 ->
    16-bit conversion per weight (a quarter-rate instruction), two values an instruction."""
    if DTYPE.is_bf16():
        return (nibbles | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
    else:
        tl.static_assert(DTYPE.is_fp16())
        return (nibbles | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
