"""Weight-streaming GEMVs for quantized weights at decode sizes (1..QUANT_GEMV_MAX_M rows):
FP8 e4m3 with group scales, and int4 packed 8 per int32 (W4A16).

At decode a quantized linear layer is bound by reading its weight, which is 2x (FP8) or
4x (int4) smaller than bf16's, so it should be that much faster than the bf16 GEMV; the
tensor-core GEMMs (fp8_gemm_triton, w4a16_gemm_triton) pad a few tokens to a 16-row MMA
tile and read the weight far below HBM bandwidth. These launch gemv_triton's kernel with
its weight format switched (`FMT_FP8`, `FMT_INT4`): each program streams its [BLOCK_N, K]
slab once, dequantizes every 64-column chunk in registers (e4m3 -> float32 times the
group's scale; nibbles -> (q - 8) * scale rounded to the activations' dtype), and feeds
the same float32 FMAs, 64-lane summation order, split-K reduce and rounding as the bf16
GEMV. So the guarantees are the same (gemv_triton's docstring):
  - row t of a batch-M launch is bitwise a batch-1 launch on that row;
  - every plan with the same split_k gives bitwise the same output, and split_k is a
    function of the shape (N, K, format) only (invariant 7);
  - no atomics, no host sync, CUDA-graph capturable (allocations: the output, and with
    split_k > 1 a float32 workspace).
Semantics, with the numerics of each format: quant_gemv.py (weight-only: activations are
not quantized).
"""

from __future__ import annotations

import os

import torch
import triton

from kvloom.kernels.arg_checks_triton import (
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
)
from kvloom.kernels.fp8_gemm import check_fp8_gemm_args
from kvloom.kernels.gemv_triton import (
    _HOPPER_SMS,
    FMT_FP8,
    FMT_INT4,
    GemvPlan,
    check_plan_table,
    hopper_block_n,
    launch_gemv,
)
from kvloom.kernels.quant_gemv import LANES, QUANT_GEMV_MAX_M, gemv_group
from kvloom.kernels.w4a16_gemm import check_w4_args

FORMATS = ("fp8", "int4")
# Columns per loop step: 256 bytes of each weight row, as the bf16 GEMV's 128 columns.
_STEP_COLUMNS = {"fp8": 256, "int4": 512}

# Measured plans by (format, N, K), then by the largest M each serves (as gemv_triton's
# GEMV_PLAN_TABLE; one split_k per entry): the fastest candidate of
# `benchmarks/quant_moe_plans.py --gemv` at 1 and 8 rows (every candidate gives the
# default plan's bits); 2..7 rows take the 8-row plan (not timed). FP8: an H200
# (2026-12-05, docs/benchmarks/data/quant_gemv_h200_2026-12-05s14.json; an H100 picked
# the same plans the next lease). int4: an H100, after the in-thread unpacking
# (data/quant_gemv_h100_2026-12-05s15.json): the H200's 8-row plan from before it
# (16 features, 256 columns, 2 warps) had become 2.5-4x the slowest. Comments: us at
# that M, then the plan replaced (or the default's).
QUANT_GEMV_PLAN_TABLE: dict[tuple[str, int, int], dict[int, GemvPlan]] = {
    ("fp8", 6144, 4096): {
        1: GemvPlan(32, 256, 4, 4, 1),  # H200 13.5 us (default 13.9)
        8: GemvPlan(16, 256, 4, 4, 1),  # H200 36.3 us (the default)
    },
    ("fp8", 4096, 4096): {
        1: GemvPlan(32, 256, 4, 4, 1),  # H200 9.1 us (default 10.9)
        8: GemvPlan(32, 256, 4, 4, 1),  # H200 26.0 us (default 27.3)
    },
    ("fp8", 24576, 4096): {
        1: GemvPlan(32, 256, 4, 4, 1),  # H200 34.4 us (default 47.7)
        8: GemvPlan(32, 256, 4, 4, 1),  # H200 122.1 us (default 164.1)
    },
    ("fp8", 4096, 12288): {
        1: GemvPlan(32, 256, 4, 4, 1),  # H200 22.5 us (default 27.4)
        8: GemvPlan(32, 256, 4, 4, 1),  # H200 69.1 us (default 73.4)
    },
    ("int4", 6144, 4096): {
        1: GemvPlan(16, 512, 4, 4, 1),  # H100 16.0 us (unchanged)
        8: GemvPlan(16, 512, 4, 4, 1),  # H100 43.0 us (was 16/256/2 warps: 104.9)
    },
    ("int4", 4096, 4096): {
        1: GemvPlan(16, 512, 4, 4, 1),  # H100 12.4 us (was 32/512/4 warps: 14.8)
        8: GemvPlan(16, 512, 4, 4, 1),  # H100 30.8 us (was 104.1)
    },
    ("int4", 24576, 4096): {
        1: GemvPlan(32, 512, 4, 3, 1),  # H100 46.9 us (unchanged)
        8: GemvPlan(16, 512, 4, 4, 1),  # H100 155.9 us (was 306.0; 64/512/8 warps 155.4)
    },
    ("int4", 4096, 12288): {
        1: GemvPlan(16, 512, 4, 4, 1),  # H100 31.6 us (was 32/512/4 warps: 41.9)
        8: GemvPlan(16, 512, 4, 4, 1),  # H100 80.8 us (was 315.1)
    },
}


def _check_table(table: dict[tuple[str, int, int], dict[int, GemvPlan]]) -> None:
    for fmt in FORMATS:
        check_plan_table({(n, k): by_m for (f, n, k), by_m in table.items() if f == fmt})
    unknown = {key[0] for key in table} - set(FORMATS)
    if unknown:
        raise ValueError(f"QUANT_GEMV_PLAN_TABLE: unknown formats {sorted(unknown)}")


_check_table(QUANT_GEMV_PLAN_TABLE)


def default_quant_gemv_plan(n: int, k: int, fmt: str) -> GemvPlan:
    """The bf16 default's block_n and warps (>= 1.5 programs per SM where N allows), steps
    of 256 bytes per weight row, and split-K when even 4-feature blocks leave the H200's
    132 SMs short of 1.5 programs each (small N, long K)."""
    block_n = hopper_block_n(n)  # the bf16 rule before its 8-row exception (not timed here)
    block_k = max(LANES, min(_STEP_COLUMNS[fmt], triton.cdiv(k, LANES) * LANES))
    programs = triton.cdiv(n, block_n)
    split_k = 1
    if 2 * programs < 3 * _HOPPER_SMS:
        split_k = min(triton.cdiv(3 * _HOPPER_SMS, 2 * programs), max(1, k // block_k), 64)
    return GemvPlan(block_n, block_k, max(1, block_n // 4), 4, split_k)


def choose_quant_gemv_plan(m: int, n: int, k: int, fmt: str) -> GemvPlan:
    """The plan for an [m, k] x [n, k]^T launch; its split_k depends on (n, k, fmt) only."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt: {fmt!r} is not one of {FORMATS}")
    if not 1 <= m <= QUANT_GEMV_MAX_M:
        raise ValueError(f"m: {m} rows is outside [1, {QUANT_GEMV_MAX_M}]")
    by_m = QUANT_GEMV_PLAN_TABLE.get((fmt, n, k))
    if by_m:
        return by_m[min(key for key in by_m if key >= m)]
    return default_quant_gemv_plan(n, k, fmt)


def fp8_gemv_triton(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    plan: GemvPlan | None = None,
) -> torch.Tensor:
    """x [..., K] (at most QUANT_GEMV_MAX_M rows) times e4m3 w_q [N, K] scaled by float32
    w_s [N, K / group_size] -> [..., N] in `out_dtype` (x's by default): quant_gemv.
    fp8_gemv_ref's semantics. `plan` overrides `choose_quant_gemv_plan`."""
    n, k = check_fp8_gemm_args(x, w_q, w_s, group_size)
    return _run(x, w_q, w_s, group_size, bias, out_dtype, plan, "fp8", n, k)


def w4a16_gemv_triton(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    plan: GemvPlan | None = None,
) -> torch.Tensor:
    """x [..., K] (at most QUANT_GEMV_MAX_M rows) times int4 `packed` [N, K / 8] scaled by
    `scale` [N, K / group_size] -> [..., N]: w4a16_gemm.w4a16_linear_ref's semantics."""
    k = x.shape[-1]
    n = check_w4_args(packed, scale, k, group_size)
    if packed.dim() != 2:
        raise ValueError(f"weight_packed: expected [N, K / 8], got shape {list(packed.shape)}")
    return _run(x, packed, scale, group_size, bias, out_dtype, plan, "int4", n, k)


def _run(x, weight, scales, group_size, bias, out_dtype, plan, fmt, n, k) -> torch.Tensor:
    _check_args(x, weight, scales, bias)
    group = gemv_group(group_size, k, packed=fmt == "int4")
    if group is None:
        raise ValueError(
            f"group_size {group_size}: the GEMV reads groups that span the row, are a "
            f"multiple of {LANES} or divide {LANES}; use the GEMM"
        )
    flat = x.reshape(-1, k)
    if flat.shape[1] > 1 and flat.stride(1) != 1:
        flat = flat.contiguous()
    m = flat.shape[0]
    if m > QUANT_GEMV_MAX_M:
        raise ValueError(f"x: {m} rows exceed QUANT_GEMV_MAX_M={QUANT_GEMV_MAX_M}; use the GEMM")
    if plan is None:
        plan = choose_quant_gemv_plan(max(m, 1), n, k, fmt)
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    fmt_id = (FMT_FP8 if fmt == "fp8" else FMT_INT4).value
    launch_gemv(flat, weight, bias, out, plan, fmt=fmt_id, scales=scales, group=group)
    return out.view(*x.shape[:-1], n)


def _check_args(x, weight, scales, bias) -> None:
    check_dtype("x", x)
    for name, tensor in (("weight", weight), ("scale", scales)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name}: must be contiguous")
    if bias is not None:
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias: expected shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        check_last_dim_contiguous("bias", bias)
    check_same_device(x=x, weight=weight, scale=scales, bias=bias)
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"x: the Triton kernel needs a CUDA tensor, got device {x.device}")
