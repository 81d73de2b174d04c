"""Which GEMM serves a prefill-size W4A16 linear: the weight dequantized to the
activations' dtype once (kernels/w4a16_dequant_triton.py), then cuBLAS; or kvloom's
Triton W4A16 GEMM, which dequantizes inside its K loop (kernels/w4a16_gemm_triton.py).

Both compute `w4a16_gemm.w4a16_linear_ref`'s semantics: the same operand (q * scale
rounded once to the activations' dtype), float32 sums, one rounding; cuBLAS sums in its
own order. Measured on an H100 (2026-12-05, quant_moe_plans.py at Qwen3-8B's shapes):
the Triton GEMM 0.091-0.273 ms at 256 tokens and 0.617-3.506 ms at 4,096, bf16 cuBLAS on
the same shapes 0.032-0.097 and 0.187-1.054 ms. The dequantization writes 2 bytes per
weight element, which cuBLAS reads back: not yet timed on a GPU.

`dequant_gemm_blocker` names the first reason a call keeps the Triton GEMM (None: it
takes cuBLAS):

- `KVLOOM_W4A16_DEQUANT_GEMM=0` turns it off;
- the deterministic mode keeps one kernel at every size (cuBLAS picks its algorithm by
  shape);
- fewer than DEQUANT_MIN_TOKENS tokens: the threshold sits above the largest decode
  batch CUDA graphs capture by default (256 rows), so eager and replayed decode steps
  of one size run one kernel (the H100 figures above would favour cuBLAS at 256 too);
- a CUDA graph is being captured: the dense weight would be a graph allocation, and
  decode batches keep their captured Triton plans;
- the activations are not bfloat16 or float16 on a CUDA device, or the output dtype is
  another (the AWQ / zero-point layers ask for float32 partial sums).
"""

from __future__ import annotations

import torch

from kvloom.contracts import envs
from kvloom.kernels import dispatch

ENABLE_ENV = "KVLOOM_W4A16_DEQUANT_GEMM"
# Above the largest decode batch CUDA graphs capture by default (module docstring).
DEQUANT_MIN_TOKENS = 512
DTYPES = (torch.bfloat16, torch.float16)


def on_cuda(x: torch.Tensor) -> bool:
    return x.is_cuda


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def dequant_gemm_blocker(x: torch.Tensor, out_dtype: torch.dtype | None = None) -> str | None:
    """Why y = x W^T (W int4) keeps the Triton W4A16 GEMM (module docstring), or None."""
    tokens = x.numel() // max(x.shape[-1], 1)
    if not envs.flag(ENABLE_ENV):
        return f"turned off ({ENABLE_ENV}=0)"
    if dispatch.batch_invariant():
        return "the deterministic mode keeps the Triton GEMM"
    if tokens < DEQUANT_MIN_TOKENS:
        return f"{tokens} tokens, below DEQUANT_MIN_TOKENS ({DEQUANT_MIN_TOKENS})"
    if not on_cuda(x) or x.dtype not in DTYPES:
        return f"activations are {x.dtype} on {x.device}, not bfloat16/float16 on CUDA"
    if (out_dtype or x.dtype) != x.dtype:
        return f"output dtype {out_dtype} is not the activations' {x.dtype}"
    if capturing():
        return "a CUDA graph is being captured"
    return None


def w4a16_linear_dequant(x, packed, scale, group_size, bias=None) -> torch.Tensor:
    """x W^T with W dequantized once (the Triton kernel), then cuBLAS in x's dtype."""
    from kvloom.kernels.w4a16_dequant_triton import dequantize_w4_triton

    weight = dequantize_w4_triton(packed, scale, group_size, x.dtype)
    return torch.nn.functional.linear(x, weight, None if bias is None else bias.to(x.dtype))
