"""L2 normalisation of q/k head vectors: the Triton kernel (`l2norm.l2norm_rows`).

fla's chunked kernels can normalise q and k themselves (`use_qk_l2norm_in_kernel`), but
their l2norm launch is autotuned on a key that grows with the token count (fla-core 0.6:
one bucket per 65,536 head vectors), so the first step of each new size re-runs the
autotuner: on an H100, Kimi-Linear-16l steps of 2,366 and 12,948 prompt tokens through
fla took 1.5 and 5.0 s (gpu_fast_path.md, twenty-ninth session). This kernel has one
fixed plan: the linear-attention wrappers normalise here and hand fla unit vectors.

Each row (one head of one token) is summed in float32 and scaled by 1 / sqrt(sum + eps),
as fla's own kernel does; the result is stored in the input's dtype. Rows are independent:
the tiling changes no result. No host synchronisation: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.kernels.arg_checks_triton import next_power_of_2

ROWS_PER_PROGRAM = 16


# The row count changes every step: not specialized, so no size compiles anew mid-run.
@triton.jit(do_not_specialize=["num_rows"])
def _l2norm_rows_kernel(
    x_ptr,
    y_ptr,
    num_rows,
    heads,
    eps,
    stride_xt,
    stride_xh,
    DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < num_rows
    ok = row_ok[:, None] & (dims < DIM)[None, :]
    token, head = rows // heads, rows % heads
    x = tl.load(
        x_ptr + (token * stride_xt + head * stride_xh)[:, None] + dims[None, :],
        mask=ok,
        other=0.0,
    ).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) + eps)
    y = x * rstd[:, None]
    tl.store(y_ptr + rows[:, None] * DIM + dims[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


def l2norm_rows_triton(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H, D] (last dim contiguous, any token and head strides) -> a contiguous
    [T, H, D] in x's dtype: each head vector over sqrt(its float32 sum of squares + eps)."""
    tokens, heads, dim = x.shape
    y = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    num_rows = tokens * heads
    if num_rows == 0 or dim == 0:
        return y
    if x.stride(2) != 1:
        x = x.contiguous()
    _l2norm_rows_kernel[(triton.cdiv(num_rows, ROWS_PER_PROGRAM),)](
        x,
        y,
        num_rows,
        heads,
        float(eps),
        x.stride(0),
        x.stride(1),
        DIM=dim,
        BLOCK_D=next_power_of_2(dim),
        ROWS=ROWS_PER_PROGRAM,
        num_warps=4,
    )
    return y
