"""int4 weights dequantized to the activations' dtype in one pass (Triton).

For prefill-size W4A16 linears (kernels/w4a16_dispatch.py): the weight is written out as
a dense [N, K] matrix once per call and the product taken by cuBLAS, instead of the
Triton W4A16 GEMM, whose in-loop dequantization held it to 222-238 TFLOP/s at 4,096
tokens on an H100 against bf16 cuBLAS's 735-796 (docs/benchmarks/quantization.md).

Semantics are `w4a16_gemm.dequantize_w4`'s, bitwise: q * scale formed in float32 and
rounded once to the output dtype (the operand the reference multiplies by). Each program
unpacks a [BLOCK_N, BLOCK_W] tile of words in the threads that load them
(`int4_nibbles_triton.word_nibbles`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.kernels.int4_nibbles_triton import nibble_q_fp32, word_nibbles
from kvloom.kernels.w4a16_gemm import PACK_FACTOR, check_w4_args

BLOCK_N = 16  # weight rows per program
BLOCK_W = 64  # int32 words per row and program (512 columns)


@triton.jit
def _dequant_w4_kernel(
    packed_ptr,
    scale_ptr,
    out_ptr,
    N,
    WORDS,
    stride_pn,
    stride_sn,
    stride_on,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    words = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    rows64 = rows.to(tl.int64)
    ok = (rows < N)[:, None] & (words < WORDS)[None, :]
    packed = tl.load(packed_ptr + rows64[:, None] * stride_pn + words[None, :], mask=ok, other=0)
    nibbles = word_nibbles(packed)  # [BLOCK_N, BLOCK_W, 8], values 0..15
    q = nibble_q_fp32(nibbles)
    cols = words[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    ok3 = ok[:, :, None]
    scale = tl.load(
        scale_ptr + rows64[:, None, None] * stride_sn + cols // GROUP, mask=ok3, other=0.0
    )
    values = (q * scale.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows64[:, None, None] * stride_on + cols, values, mask=ok3)


def dequantize_w4_triton(
    packed: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """[N, K / 8] int32 + [N, K / group_size] -> [N, K] in `dtype`: dequantize_w4's bits."""
    if packed.dim() != 2:
        raise ValueError(f"weight_packed: expected [N, K / 8], got shape {list(packed.shape)}")
    words = packed.shape[1]
    n = check_w4_args(packed, scale, words * PACK_FACTOR, group_size)
    if packed.stride(1) != 1 or scale.stride(1) != 1:
        raise ValueError("weight_packed and weight_scale: the last dim must be contiguous")
    if packed.device != scale.device:
        raise ValueError(f"weight_scale: on {scale.device}, the weight on {packed.device}")
    out = torch.empty((n, words * PACK_FACTOR), dtype=dtype, device=packed.device)
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(words, BLOCK_W))
    _dequant_w4_kernel[grid](
        packed,
        scale,
        out,
        n,
        words,
        packed.stride(0),
        scale.stride(0),
        out.stride(0),
        GROUP=group_size,
        BLOCK_N=BLOCK_N,
        BLOCK_W=BLOCK_W,
        num_warps=4,
    )
    return out
