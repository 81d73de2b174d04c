"""Unpacking int4 words in Triton kernels (the W4A16 GEMV, GEMM and fused MoE).

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
