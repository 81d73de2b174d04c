"""Small-M linear layer y = x @ W^T (+ bias) for decode: a weight-streaming Triton GEMV.

At batch 1..8 a linear layer reads its whole weight once and does M multiply-adds per
weight element, so it is bound by HBM bandwidth. One program owns BLOCK_N output features
for all M rows: it streams its [BLOCK_N, K] weight slab once, BLOCK_K columns per loop
step (num_stages > 1: software-pipelined through shared memory by `tl.range`; 1: plain
loads, all chunks of a step in flight at once), and each weight tile is converted to
float32 once and used by every row. No tensor cores: with
M <= 8 the CUDA cores keep up with HBM, and the summation order stays ours to define.

Summation order (the same for every M and every plan with the same `split_k`):
  the K axis is cut into LANES = 64 interleaved lanes (lane j holds k = j, j + 64, ...).
  Each lane accumulates its terms in increasing k with a float32 fused multiply-add;
  the 64 lane sums are then added by a fixed pairwise tree ((0+1), (2+3), ... and so on
  up). A row's arithmetic never touches another row, and BLOCK_N / BLOCK_K / num_warps /
  num_stages only change how the same operations are scheduled, so:
  - row t of a batch-M launch is bitwise equal to a batch-1 launch on that row, and
  - every plan with the same `split_k` gives bitwise the same output (invariant 7).
  With split_k = S > 1 the K axis is first cut into S contiguous ranges (multiples of
  LANES); each range is summed as above into a float32 workspace [S, M, N], and a second
  launch adds the S partials in order 0..S-1. That is a different order from S = 1, so
  `choose_gemv_plan` keeps S a function of the shape only, never of M.
Rounding is the reference's (`gemv.gemv_ref`): float32 sum, + bias in float32, one
rounding to x's dtype.

Deterministic (no atomics in any sum) and CUDA-graph capturable: no host sync; it
allocates only the output and, with split_k > 1, a float32 workspace of S * M * N elements.

The same kernel streams quantized weights (WFMT: FMT_FP8 e4m3, FMT_INT4 packed int4, with
group scales; quant_gemv_triton.py is their entry): only the load and in-register
dequantization of each 64-column chunk change, so the summation order and the
guarantees above are the same. FMT_PLAIN does the arithmetic it always did (its row
stride is now an argument, equal to K).

`gemv_silu_and_mul_triton` is the gated MLP's gate_up GEMV with silu(gate) * up applied
at the store (GATED): a program's tile pairs gate row f with up row I + f, sums both
exactly as the plain GEMV does, rounds each to x's dtype as the plain store does, and
runs the activation kernel's arithmetic once per output element. The result is bitwise
the plain GEMV followed by `activation_triton.silu_and_mul_triton`, in one launch
(split_k > 1: the activation moves to the reduce launch).

`gemv_conv_triton` / `rms_norm_gemv_conv_triton` (CONV) are Gated DeltaNet's decode
in_proj with the depthwise conv's decode step in the epilogue: its first C output
features are the conv channels, each owned by one program, which after storing the
feature's y (rounded as the plain store rounds it) runs the conv update kernel's helper
(causal_conv1d_triton.conv1d_update_channels) on each row's state slot: bitwise the GEMV
followed by `causal_conv1d_update_triton`, one launch (split_k > 1: two).

`gemv_route_triton` / `rms_norm_gemv_route_triton` (ROUTE) are a MoE layer's router GEMV
with the softmax top-k router in the same launch: every program arrives at a per-device
counter after storing its logits, and the last to arrive routes each row with the router
kernel's code (moe_router_triton.softmax_topk_row) on the stored logits. Which program
routes depends on timing, but it reads the same stored values and computes them alone:
bitwise the GEMV followed by `softmax_topk_triton`, one launch.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from kvloom.contracts import envs
from kvloom.kernels.activation_triton import silu_mul
from kvloom.kernels.arg_checks_triton import (
    check_dtype,
    check_same_device,
    is_interpreted,
    next_power_of_2,
)
from kvloom.kernels.arrival_counters import arrival_counters
from kvloom.kernels.causal_conv1d_triton import ACTIVATIONS as CONV_ACTIVATIONS
from kvloom.kernels.causal_conv1d_triton import (
    causal_conv1d_update_triton,
    check_conv_update_args,
    conv1d_update_channels,
)
from kvloom.kernels.gemv import CONV_GEMV_MAX_M, GEMV_MAX_M, NORM_GEMV_MAX_K, NORM_GEMV_MAX_M
from kvloom.kernels.int4_nibbles_triton import nibble_q_16bit, nibble_q_fp32, word_nibbles
from kvloom.kernels.moe_router import check_router_args
from kvloom.kernels.moe_router_triton import (
    MAX_EXPERTS,
    PICKS_PER_ROUND,
    SHARED_MODES,
    check_picks,
    check_renormalize,
    router_num_warps,
    routes_out,
    softmax_topk_row,
    softmax_topk_triton,
)
from kvloom.kernels.pdl_triton import pdl_launch, prefetch_l2, uses_pdl
from kvloom.kernels.rms_norm_triton import (
    rms_row_rstd,
    rms_scale,
    rms_sum,
    sq_lanes,
)

LANES = 64  # fixes the summation order; never depends on a plan
_LANES = tl.constexpr(LANES)  # the same, readable inside kernels
_HOPPER_SMS = 132  # H100 / H200 SXM; the default plan aims at >= 1.5 programs per SM
_REDUCE_BLOCK = 1024  # features per program of the split-K reduce launch

# How the weight is stored (the kernel's WFMT): x's dtype; e4m3 [N, K] with float32
# group scales; int4 packed 8 per int32 [N, K / 8] with group scales (quant_gemv_triton).
FMT_PLAIN = tl.constexpr(0)
FMT_FP8 = tl.constexpr(1)
FMT_INT4 = tl.constexpr(2)


def _is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


@dataclasses.dataclass(frozen=True)
class GemvPlan:
    """Tiling of one gemv launch; it changes speed only, never results (same split_k)."""

    block_n: int  # output features per program (power of 2)
    block_k: int  # K columns per loop step (a multiple of LANES)
    num_warps: int
    num_stages: int  # software-pipelining depth of the K loop (1: none)
    split_k: int = 1  # > 1: K split over programs, partials reduced by a second launch

    def __post_init__(self) -> None:
        def bad(field: str, value: int, want: str) -> ValueError:
            return ValueError(f"plan.{field}: {value!r} is not {want}")

        for field in ("block_n", "block_k", "num_warps", "num_stages", "split_k"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool):
                raise bad(field, value, "an int")
        if not (1 <= self.block_n <= 256 and _is_pow2(self.block_n)):
            raise bad("block_n", self.block_n, "a power of 2 in [1, 256]")
        if not (LANES <= self.block_k <= 4096 and self.block_k % LANES == 0):
            raise bad("block_k", self.block_k, f"a multiple of {LANES} in [{LANES}, 4096]")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise bad("num_warps", self.num_warps, "one of 1, 2, 4, 8, 16")
        if not 1 <= self.num_stages <= 8:
            raise bad("num_stages", self.num_stages, "in [1, 8]")
        if not 1 <= self.split_k <= 64:
            raise bad("split_k", self.split_k, "in [1, 64]")

    @property
    def name(self) -> str:
        return (
            f"n{self.block_n}_k{self.block_k}_w{self.num_warps}_s{self.num_stages}_sk{self.split_k}"
        )


# Measured plans for 16-bit weights, keyed by (N, K), then by the largest M each plan
# serves (a launch with m rows takes the smallest key >= m). benchmarks/gemv_plans.py
# prints entries in this form. All plans of one shape must share split_k (checked below),
# so the output of a row never depends on how many rows share its launch.
# Measured on an H200 (torch 2.11, Triton 3.6) by benchmarks/gemv_plans.py, each plan
# timed inside a CUDA graph over weights that do not fit in L2 (2026-11-30); the
# comments give its time and its speed against cuBLAS at that M.
GEMV_PLAN_TABLE: dict[tuple[int, int], dict[int, GemvPlan]] = {
    (6144, 4096): {  # N, K
        1: GemvPlan(4, 128, 1, 6, 1),  # 13.7 us, 3668 GB/s, 1.10x cuBLAS
        2: GemvPlan(16, 128, 4, 6, 1),  # 14.7 us, 3425 GB/s, 1.05x cuBLAS
        4: GemvPlan(32, 128, 4, 6, 1),  # 19.4 us, 2592 GB/s, 0.82x cuBLAS
        8: GemvPlan(32, 128, 4, 6, 1),  # 32.9 us, 1528 GB/s, 0.47x cuBLAS
    },
    (4096, 4096): {  # N, K
        1: GemvPlan(16, 128, 4, 8, 1),  # 10.6 us, 3179 GB/s, 1.27x cuBLAS
        2: GemvPlan(4, 128, 1, 6, 1),  # 11.2 us, 3004 GB/s, 1.17x cuBLAS
        4: GemvPlan(32, 128, 4, 6, 1),  # 13.4 us, 2512 GB/s, 0.98x cuBLAS
        8: GemvPlan(32, 128, 4, 6, 1),  # 20.3 us, 1650 GB/s, 0.64x cuBLAS
    },
    (24576, 4096): {  # N, K
        1: GemvPlan(64, 128, 8, 4, 1),  # 47.4 us, 4246 GB/s, 1.01x cuBLAS
        2: GemvPlan(64, 128, 8, 4, 1),  # 49.3 us, 4082 GB/s, 0.97x cuBLAS
        4: GemvPlan(64, 128, 8, 4, 1),  # 54.3 us, 3706 GB/s, 0.88x cuBLAS
        8: GemvPlan(32, 128, 4, 6, 1),  # 92.5 us, 2175 GB/s, 0.57x cuBLAS
    },
    (4096, 12288): {  # N, K
        1: GemvPlan(16, 128, 4, 8, 1),  # 25.2 us, 4000 GB/s, 1.19x cuBLAS
        2: GemvPlan(16, 256, 4, 4, 1),  # 26.5 us, 3794 GB/s, 1.14x cuBLAS
        4: GemvPlan(32, 128, 4, 6, 1),  # 33.4 us, 3010 GB/s, 0.90x cuBLAS
        8: GemvPlan(32, 128, 4, 6, 1),  # 53.5 us, 1882 GB/s, 0.56x cuBLAS
    },
    (12288, 2048): {  # N, K
        1: GemvPlan(16, 128, 4, 4, 1),  # 13.8 us, 3656 GB/s, 1.11x cuBLAS
        2: GemvPlan(32, 128, 4, 6, 1),  # 14.5 us, 3480 GB/s, 1.04x cuBLAS
        4: GemvPlan(32, 128, 4, 6, 1),  # 16.8 us, 3004 GB/s, 0.90x cuBLAS
        8: GemvPlan(32, 128, 4, 6, 1),  # 27.3 us, 1842 GB/s, 0.56x cuBLAS
    },
    (2048, 4096): {  # N, K
        1: GemvPlan(16, 128, 4, 8, 1),  # 7.1 us, 2360 GB/s, 1.31x cuBLAS
        2: GemvPlan(4, 128, 1, 6, 1),  # 7.8 us, 2161 GB/s, 1.23x cuBLAS
        4: GemvPlan(16, 256, 4, 4, 1),  # 10.4 us, 1610 GB/s, 0.90x cuBLAS
        8: GemvPlan(16, 256, 4, 4, 1),  # 15.4 us, 1088 GB/s, 0.61x cuBLAS
    },
    # Qwen3-Next's fused GDN input projection (in_proj_qkvz + in_proj_ba: 64 more rows than
    # the entry above): the (12288, 2048) plans reused, not yet measured at this shape.
    (12352, 2048): {  # N, K
        1: GemvPlan(16, 128, 4, 4, 1),
        2: GemvPlan(32, 128, 4, 6, 1),
        4: GemvPlan(32, 128, 4, 6, 1),
        8: GemvPlan(32, 128, 4, 6, 1),
    },
    (9216, 2048): {  # N, K
        1: GemvPlan(16, 128, 4, 4, 1),  # 11.1 us, 3411 GB/s, 1.06x cuBLAS
        2: GemvPlan(16, 128, 4, 4, 1),  # 12.1 us, 3118 GB/s, 0.96x cuBLAS
        4: GemvPlan(32, 128, 4, 6, 1),  # 16.2 us, 2333 GB/s, 0.71x cuBLAS
        8: GemvPlan(32, 128, 4, 6, 1),  # 27.0 us, 1399 GB/s, 0.43x cuBLAS
    },
    (1024, 2048): {  # N, K
        1: GemvPlan(4, 128, 1, 6, 1),  # 4.1 us, 1021 GB/s, 3.08x cuBLAS
        2: GemvPlan(4, 128, 1, 6, 1),  # 4.6 us, 920 GB/s, 2.26x cuBLAS
        4: GemvPlan(16, 256, 4, 4, 1),  # 6.2 us, 673 GB/s, 1.75x cuBLAS
        8: GemvPlan(16, 128, 4, 4, 1),  # 8.9 us, 469 GB/s, 0.65x cuBLAS
    },
    (2048, 512): {  # N, K
        1: GemvPlan(4, 128, 1, 6, 1),  # 2.6 us, 800 GB/s, 1.37x cuBLAS
        2: GemvPlan(4, 128, 1, 6, 1),  # 2.9 us, 729 GB/s, 1.26x cuBLAS
        4: GemvPlan(16, 128, 4, 4, 1),  # 3.5 us, 603 GB/s, 1.04x cuBLAS
        8: GemvPlan(16, 128, 4, 4, 1),  # 4.3 us, 490 GB/s, 0.84x cuBLAS
    },
}
# Kimi-Linear's attention output projections (32 heads x 128 -> 2,304; KDA and MLA) and its
# dense layer's down projection, measured on an H100 (benchmarks/gemv_plans.py --shapes
# 4096,2304 9216,2304; docs/benchmarks/data/gemv_plans_kimi_h100_2026-12-06s23.json). The
# default plan (8 rows a program, 2 warps) took 23.0 us and 55.8 us at M = 1 here.
GEMV_PLAN_TABLE[(2304, 4096)] = {  # N, K
    1: GemvPlan(4, 128, 1, 6, 1),  # 8.5 us, 2210 GB/s, 1.24x cuBLAS
    2: GemvPlan(4, 128, 1, 6, 1),  # 9.9 us, 1909 GB/s, 1.15x cuBLAS
    4: GemvPlan(32, 128, 4, 6, 1),  # 12.7 us, 1482 GB/s, 0.89x cuBLAS
    8: GemvPlan(32, 128, 4, 6, 1),  # 20.1 us, 940 GB/s, 0.57x cuBLAS
}
GEMV_PLAN_TABLE[(2304, 9216)] = {  # N, K
    1: GemvPlan(4, 128, 1, 6, 4),  # 18.5 us, 2293 GB/s, 1.06x cuBLAS
    2: GemvPlan(4, 128, 1, 6, 4),  # 19.9 us, 2134 GB/s, 0.98x cuBLAS
    4: GemvPlan(4, 128, 1, 6, 4),  # 24.7 us, 1721 GB/s, 0.81x cuBLAS
    8: GemvPlan(4, 128, 1, 6, 4),  # 38.6 us, 1101 GB/s, 0.51x cuBLAS
}


def check_plan_table(table: dict[tuple[int, int], dict[int, GemvPlan]]) -> None:
    """Every shape's entry covers M up to GEMV_MAX_M with plans of one split_k."""
    for shape, by_m in table.items():
        if not by_m or max(by_m) < GEMV_MAX_M or min(by_m) < 1:
            raise ValueError(
                f"GEMV_PLAN_TABLE[{shape}]: M keys {sorted(by_m)} must lie in "
                f"[1, {GEMV_MAX_M}] and include {GEMV_MAX_M}"
            )
        splits = {plan.split_k for plan in by_m.values()}
        if len(splits) != 1:
            raise ValueError(
                f"GEMV_PLAN_TABLE[{shape}]: plans mix split_k {sorted(splits)}; one split_k "
                "per shape keeps results independent of M"
            )


check_plan_table(GEMV_PLAN_TABLE)


def hopper_block_n(n: int) -> int:
    """The widest block_n of 32, 16 and 8 that still gives >= 1.5 programs per SM, else 4."""
    for candidate in (32, 16, 8):
        if triton.cdiv(n, candidate) * 2 >= 3 * _HOPPER_SMS:
            return candidate
    return 4


def default_gemv_plan(n: int, k: int) -> GemvPlan:
    """A Hopper default: `hopper_block_n`'s rows a program, 8 elements (16 bytes of bf16)
    per thread per 64-lane chunk, and memory parallelism from a 6-stage pipeline of
    128-column steps (5 steps, 5 * block_n * 256 bytes, in flight per program). Plain
    loads (num_stages = 1) keep only about two 16-byte loads in flight per thread (ptxas
    does not hoist the next chunk's loads), too few for HBM; deeper steps (more chunks per
    step) multiply the pipelined loads and the compile time.

    Never 8 rows on 2 warps: at one row that plan ran 1.2-3.3x slower than 4 rows on 1
    warp at 13 of the 14 shapes where both were timed (2-3.3x at nine; 4% faster at K 128;
    an H200 and an H100: docs/benchmarks/data/gemv_plans_h200.json,
    gemv_plans_kimi_h100_2026-12-06s23.json; e.g. N 2,304 x K 4,096 23.0 against 8.5 us),
    so N of 1,577-3,152 takes 4 rows."""
    block_n = hopper_block_n(n)
    if block_n == 8:
        block_n = 4
    return GemvPlan(block_n, 128, max(1, block_n // 4), 6, 1)


def choose_gemv_plan(m: int, n: int, k: int, dtype: torch.dtype) -> GemvPlan:
    """The plan for an [m, k] x [n, k]^T launch: the measured table for 16-bit dtypes,
    else the default. The split_k it returns depends on (n, k, dtype) only."""
    if not 1 <= m <= GEMV_MAX_M:
        raise ValueError(f"m: {m} rows is outside [1, GEMV_MAX_M={GEMV_MAX_M}]")
    if n < 1 or k < 0:
        raise ValueError(f"n, k: expected n >= 1 and k >= 0, got n={n}, k={k}")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype: {dtype} is not float16, bfloat16 or float32")
    by_m = GEMV_PLAN_TABLE.get((n, k)) if dtype != torch.float32 else None
    if by_m:
        return by_m[min(key for key in by_m if key >= m)]
    return default_gemv_plan(n, k)


def split_k_len(k: int, split_k: int) -> int:
    """Columns per K range with split_k ranges: a multiple of LANES (the last may be short)."""
    return triton.cdiv(triton.cdiv(k, LANES), split_k) * LANES


def is_even_k(k: int, plan: GemvPlan) -> bool:
    """Whether every K range is whole loop steps (the kernel then loads without masks);
    one of the compile-time switches, with M and the plan's fields."""
    split_len = split_k_len(k, plan.split_k)
    return split_len % plan.block_k == 0 and split_len * plan.split_k == k


@triton.jit
def _pair_sum(v, BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """[BLOCK_N, 2 * HALF] -> [BLOCK_N, HALF]: lane i becomes lanes 2i + (2i + 1)."""
    even, odd = tl.split(tl.reshape(v, [BLOCK_N, HALF, 2]))
    return even + odd


@triton.jit
def _lane_tree_sum(acc, BLOCK_N: tl.constexpr):
    """Adds the 64 lane sums of each feature in a fixed pairwise order (layout-free)."""
    v = _pair_sum(acc, BLOCK_N, 32)
    v = _pair_sum(v, BLOCK_N, 16)
    v = _pair_sum(v, BLOCK_N, 8)
    v = _pair_sum(v, BLOCK_N, 4)
    v = _pair_sum(v, BLOCK_N, 2)
    v = _pair_sum(v, BLOCK_N, 1)
    return tl.reshape(v, [BLOCK_N])


@triton.jit
def _row_fma(acc, w, x_row, kk, lanes, k_end, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr):
    """acc[n, j] = fma(w[n, j], x[kk + j], acc[n, j]) for one row's 64-lane chunk (`lanes`
    is [64], or the same 64 offsets as an [8, 8] grid for packed int4)."""
    if EVEN_K:
        x = tl.load(x_row + kk + lanes)
    else:
        x = tl.load(x_row + kk + lanes, mask=kk + lanes < k_end, other=0.0)
    x = tl.broadcast_to(tl.expand_dims(x.to(tl.float32), 0), w.shape)
    return tl.fma(w, x, acc)


@triton.jit
def _normed_row_fma(
    acc,
    w,
    row,
    rstd,
    x_ptr,
    stride_xm,
    r_ptr,
    stride_rm,
    nw_ptr,
    ro_ptr,
    no_ptr,
    weight_offset,
    store_end,
    kk,
    lanes,
    k_end,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    WRITE_NORMED: tl.constexpr,
):
    """_row_fma of row `row` whose x is RMSNorm(x + residual), made per 64-lane chunk by
    rms_norm_triton's helpers and rounded to x's dtype as the norm launch stores it.
    Columns below `store_end` (k_end in the first feature tile's programs, else 0) also
    store the sum (the new residual) and, with WRITE_NORMED, the normed values: fresh
    [M, K] buffers no program reads."""
    dtype = x_ptr.dtype.element_ty
    cols = kk + lanes
    ok = cols < k_end
    if EVEN_K:
        x = tl.load(x_ptr + row * stride_xm + cols)
        w_norm = tl.load(nw_ptr + cols)
        res = x
        if HAS_RESIDUAL:
            res = tl.load(r_ptr + row * stride_rm + cols)
    else:
        x = tl.load(x_ptr + row * stride_xm + cols, mask=ok, other=0.0)
        w_norm = tl.load(nw_ptr + cols, mask=ok, other=0.0)
        res = x
        if HAS_RESIDUAL:
            res = tl.load(r_ptr + row * stride_rm + cols, mask=ok, other=0.0)
    s = rms_sum(x, res, HAS_RESIDUAL, dtype)
    normed = rms_scale(s, w_norm, rstd, weight_offset, HAS_OFFSET, dtype).to(dtype)
    if HAS_RESIDUAL:
        tl.store(ro_ptr + row * K + cols, s, mask=cols < store_end)
    if WRITE_NORMED:
        tl.store(no_ptr + row * K + cols, normed, mask=cols < store_end)
    x = tl.broadcast_to(tl.expand_dims(normed.to(tl.float32), 0), w.shape)
    return tl.fma(w, x, acc)


@triton.jit
def _lane_offsets(WFMT: tl.constexpr):
    """k - kk of each lane: [64]; for packed int4 an [8, 8] grid (word, nibble), lane
    8 * word + nibble, so one int32 word feeds 8 lanes with no reshape in the loop."""
    if WFMT == FMT_INT4:
        return tl.arange(0, 8)[:, None] * 8 + tl.arange(0, 8)[None, :]
    else:
        return tl.arange(0, _LANES)


@triton.jit
def _new_acc(BLOCK_N: tl.constexpr, WFMT: tl.constexpr):
    if WFMT == FMT_INT4:
        return tl.zeros([BLOCK_N, 8, 8], dtype=tl.float32)
    else:
        return tl.zeros([BLOCK_N, _LANES], dtype=tl.float32)


@triton.jit
def _scale_at(
    s_rows, k, K, EVEN_K: tl.constexpr, GROUP: tl.constexpr, AS_FP32: tl.constexpr = True
):
    """Scales of the groups holding columns `k` (any shape broadcasting against s_rows),
    as float32 or (AS_FP32 False) as stored. Columns past K (a masked tail) read group
    K - 1's scale: in bounds, times a zero."""
    if not EVEN_K:
        k = tl.minimum(k, K - 1)
    scale = tl.load(s_rows + k // GROUP)
    if AS_FP32:
        scale = scale.to(tl.float32)
    return scale


@triton.jit
def _weight_chunk(
    w_tile,
    s_rows,
    row_scale,
    kk,
    lanes,
    k_end,
    K,
    W_DTYPE: tl.constexpr,
    WFMT: tl.constexpr,
    GROUP: tl.constexpr,
    EVEN_K: tl.constexpr,
    HALF_DEQUANT: tl.constexpr,
):
    """The float32 weights of columns [kk, kk + 64), shaped like the accumulator.
    FMT_FP8: e4m3 * its group's float32 scale (one float32 rounding, no activation
    quantization). FMT_INT4: (q - 8) * scale rounded once to W_DTYPE (the activations'
    dtype), as w4a16_gemm's reference holds its operand; HALF_DEQUANT (launch_gemv says
    when) computes the same bits in 16-bit arithmetic. GROUP 0: one scale per row."""
    if WFMT == FMT_INT4:
        # kk is a multiple of 64 (split ranges and steps are): 8-word aligned, so the
        # word loads can be 32-byte vectors.
        kk = tl.multiple_of(kk, 64)
        word_k = kk + tl.arange(0, 8) * 8  # first column of each word
        # A row's eight words are 32-byte aligned (the compiler does not carry kk's
        # alignment through the division). With 16 features a tile is 128 words, one per
        # thread of 4 warps, so the copies stay 4 bytes wide either way.
        word0 = tl.multiple_of(kk // 8, 8)
        if EVEN_K:
            words = tl.load(w_tile + word0, eviction_policy="evict_first")
        else:
            words = tl.load(
                w_tile + word0,
                mask=(word_k < k_end)[None, :],
                other=0,
                eviction_policy="evict_first",
            )
        # Each word's nibbles stay in its thread (word_nibbles): sm_90 PTX of one
        # 512-column step (16 features, 4 warps) went from 1,079 instructions with 64
        # shared-memory word loads to 776 with none (Triton 3.9; 3.6: 1,065 and 757), the
        # same bits.
        nibbles = word_nibbles(words)
        if HALF_DEQUANT:  # the same bits in 16-bit arithmetic (nibble_q_16bit)
            tl.static_assert(GROUP != 0)  # a row scale stays float32 (launch_gemv)
            q16 = nibble_q_16bit(nibbles, W_DTYPE)
            if GROUP % 64 == 0:
                scale16 = _scale_at(s_rows, kk, K, EVEN_K, GROUP, False)[:, None, None]
            else:
                scale16 = _scale_at(s_rows[:, None], word_k[None, :], K, EVEN_K, GROUP, False)[
                    :, :, None
                ]
            return (q16 * scale16).to(tl.float32)
        q = nibble_q_fp32(nibbles)
        if GROUP == 0:
            scale = row_scale[:, None, None]
        elif GROUP % 64 == 0:  # the chunk is inside one group
            scale = _scale_at(s_rows, kk, K, EVEN_K, GROUP)[:, None, None]
        else:  # groups of 8..32 columns: one scale per word
            scale = _scale_at(s_rows[:, None], word_k[None, :], K, EVEN_K, GROUP)[:, :, None]
        return (q * scale).to(W_DTYPE).to(tl.float32)
    else:
        if WFMT == FMT_FP8:
            kk = tl.multiple_of(kk, 64)  # as above: 64-byte aligned e4m3 chunks
        if EVEN_K:
            w = tl.load(w_tile + kk, eviction_policy="evict_first")
        else:
            k_ok = (kk + lanes < k_end)[None, :]
            w = tl.load(w_tile + kk, mask=k_ok, other=0.0, eviction_policy="evict_first")
        w = w.to(tl.float32)
        if WFMT == FMT_FP8:
            if GROUP == 0:
                w = w * row_scale[:, None]
            elif GROUP % 64 == 0:
                w = w * _scale_at(s_rows, kk, K, EVEN_K, GROUP)[:, None]
            else:
                w = w * _scale_at(s_rows[:, None], (kk + lanes)[None, :], K, EVEN_K, GROUP)
        return w


@triton.jit
def _store_row(
    acc,
    bias,
    out_row,
    n_offs,
    n_mask,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WFMT: tl.constexpr,
    GATED: tl.constexpr,
):
    if WFMT == FMT_INT4:
        acc = tl.reshape(acc, [BLOCK_N, _LANES])  # lane 8 * word + nibble, as _lane_offsets
    y = _lane_tree_sum(acc, BLOCK_N)
    if HAS_BIAS:
        y = y + bias
    dtype = out_row.dtype.element_ty
    if GATED:
        # Tile rows 2f, 2f + 1 are feature f's gate and up sums. Each is rounded to the
        # output dtype, as the plain GEMV stores it, before the activation reads it.
        gate, up = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
        y = silu_mul(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype)
    y = y.to(dtype)
    tl.store(out_row + n_offs, y, mask=n_mask)
    return y


@triton.jit
def _conv_epilogue(
    y,
    row,
    n_offs,
    n_mask,
    conv_c,
    cw_ptr,
    stride_cw,
    cs_ptr,
    stride_css,
    stride_csc,
    slot_ptr,
    co_ptr,
    stride_com,
    WIDTH: tl.constexpr,
    WIDTH_PAD: tl.constexpr,
    SILU: tl.constexpr,
):
    """The conv update of row `row` on this tile's conv channels (features < conv_c): y,
    the row's outputs as the GEMV stored them, is each channel's new input; the conv runs
    causal_conv1d_triton's arithmetic (its shared helper) on the row's slot of the pool
    and stores to co_ptr [ROWS, conv_c]. A padding row (slot < 0) gets zeros and its
    slot is not touched, as the conv launch does. A channel is one feature, and one
    program owns it: no other program reads or writes its state."""
    is_conv = n_mask & (n_offs < conv_c)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    # A vector, not a scalar: the interpreter turns (vector & scalar bool) into integers.
    live = tl.broadcast_to(slot, n_offs.shape) >= 0
    state_row = cs_ptr + tl.maximum(slot, 0) * stride_css
    conv = conv1d_update_channels(
        y.to(tl.float32), n_offs, is_conv & live, state_row, stride_csc, cw_ptr, stride_cw,
        cw_ptr, WIDTH, WIDTH_PAD, False, SILU,
    )  # fmt: skip
    conv = tl.where(live, conv, 0.0)
    tl.store(co_ptr + row * stride_com + n_offs, conv.to(co_ptr.dtype.element_ty), mask=is_conv)


@triton.jit
def _route_epilogue(
    out0,
    stride_om,
    counter_ptr,
    rw_ptr,
    stride_rwm,
    rid_ptr,
    stride_ridm,
    route_experts,
    ROWS: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SHARED: tl.constexpr,
    PICKS: tl.constexpr,
):
    """The softmax top-k router on the logits this launch stored (ROUTE): every program
    arrives at the launch's counter after its stores; the last to arrive routes each row
    with the router launch's code (moe_router_triton.softmax_topk_row) on the stored,
    rounded logits, then sets the counter back to 0 for the next launch. The barrier puts
    every thread's stores before the release; the acquire puts the other programs' stores
    before this program's loads (fused_moe_triton's slot sum does the same)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        for row in tl.static_range(ROWS):
            softmax_topk_row(
                out0 + row * stride_om, 1, rw_ptr + row * stride_rwm, rid_ptr + row * stride_ridm,
                route_experts, TOP_K, K_PAD, E_PAD, RENORMALIZE, SHARED, PICKS,
            )  # fmt: skip
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    stride_os,
    split_len,
    r_ptr,
    nw_ptr,
    ro_ptr,
    no_ptr,
    stride_rm,
    eps,
    weight_offset,
    conv_c,
    cw_ptr,
    stride_cw,
    cs_ptr,
    stride_css,
    stride_csc,
    slot_ptr,
    co_ptr,
    stride_com,
    counter_ptr,
    rw_ptr,
    stride_rwm,
    rid_ptr,
    stride_ridm,
    route_experts,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNKS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WFMT: tl.constexpr,
    GROUP: tl.constexpr,
    GATED: tl.constexpr,
    NORM: tl.constexpr,
    NORM_K: tl.constexpr,
    NORM_LANES: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    WRITE_NORMED: tl.constexpr,
    CONV: tl.constexpr,
    CONV_WIDTH: tl.constexpr,
    CONV_WIDTH_PAD: tl.constexpr,
    CONV_SILU: tl.constexpr,
    ROUTE: tl.constexpr = False,
    ROUTE_TOP_K: tl.constexpr = 1,
    ROUTE_K_PAD: tl.constexpr = 1,
    ROUTE_E_PAD: tl.constexpr = 1,
    ROUTE_RENORMALIZE: tl.constexpr = False,
    ROUTE_SHARED: tl.constexpr = 0,
    ROUTE_PICKS: tl.constexpr = 2,
    GDC: tl.constexpr = 0,
    PREFETCH_LINES: tl.constexpr = 1,
    LINE: tl.constexpr = 64,
    HALF_DEQUANT: tl.constexpr = False,
):
    """Program (i, s): features [i * BLOCK_N, (i + 1) * BLOCK_N) of all ROWS rows over K
    range s. Rows are unrolled by hand (one accumulator each, ROWS <= 8) so every row
    runs the same arithmetic whatever ROWS is; rows past ROWS are compiled out. WFMT
    says how the weight is stored (FMT_*); s_ptr holds its group scales (quantized).
    GATED (split_k = 1 only): the weight is [gate; up] with 2N rows and the output
    [ROWS, N] is silu(gate) * up; program i owns features [i * BLOCK_N / 2, ...) and its
    tile interleaves their gate and up rows. Only which weight rows the tile reads and
    the store change: every sum is the plain GEMV's, bit for bit.
    NORM (ROWS <= 2, K = NORM_K): x is RMSNorm(x + residual) of the rows at x_ptr and
    r_ptr (HAS_RESIDUAL), norm weight nw_ptr: every program computes each row's whole
    1 / rms first (rms_row_rstd), then normalizes each chunk as it streams the weight;
    the first feature tile stores the sum to ro_ptr and (WRITE_NORMED) the normed rows
    to no_ptr ([ROWS, K] each).
    CONV (ROWS <= 2, split_k = 1, not GATED): features < conv_c are also the channels of a
    depthwise causal conv's decode step (_conv_epilogue), run on each row's stored y.
    ROUTE (split_k = 1, not GATED): the outputs are router logits, and the launch's last
    program runs the softmax top-k router on them (_route_epilogue).
    GDC (programmatic dependent launch, kernels/pdl_triton.py): the program may start
    before the launch it follows has finished. It lets the next launch stage (at its
    start with GDC 1, after its main loop with GDC 2, at exit with 3), asks for
    the first PREFETCH_LINES lines (LINE elements each) of its K range of each plain
    weight row to be brought into L2, and only then waits for the launch before it: x,
    the residual, the conv state and the outputs may be that launch's."""
    tl.static_assert(_LANES == 64)  # _lane_tree_sum is written for 64 lanes
    tl.static_assert(ROWS <= 8)
    tl.static_assert(not NORM or (ROWS <= 2 and WFMT == FMT_PLAIN))
    tl.static_assert(not CONV or (ROWS <= 2 and not GATED))  # CONV_GEMV_MAX_M
    tl.static_assert(not ROUTE or not GATED)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    if GATED:
        n_offs = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        n_mask = n_offs < N
        tile_row = tl.arange(0, BLOCK_N)
        feature = tl.minimum(pid_n * (BLOCK_N // 2) + tile_row // 2, N - 1)
        n_rows = (feature + (tile_row % 2) * N).to(tl.int64)  # gate row, then up row
    else:
        n_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n_offs < N
        # Tail features re-read feature N - 1 (in bounds, so weight loads need no mask);
        # their results are never stored.
        n_rows = tl.minimum(n_offs, N - 1).to(tl.int64)
    lanes = _lane_offsets(WFMT)
    if WFMT == FMT_INT4:  # pointers to each row's first 8 words (64 columns)
        w_tile = w_ptr + n_rows[:, None] * stride_wn + tl.arange(0, 8)[None, :]
    else:
        w_tile = w_ptr + n_rows[:, None] * stride_wn + lanes[None, :]
    s_rows = s_ptr + n_rows * stride_sn
    row_scale = tl.zeros([BLOCK_N], dtype=tl.float32)
    if WFMT != FMT_PLAIN and GROUP == 0:  # one scale per row: read it once
        row_scale = tl.load(s_rows).to(tl.float32)
    k_start = pid_s * split_len
    k_end = tl.minimum(k_start + split_len, K)
    out0 = out_ptr + pid_s * stride_os  # row 0's output
    if GDC:
        if GDC == 1:  # RELEASE_AT["start"]
            tl.extra.cuda.gdc_launch_dependents()
        if WFMT == FMT_PLAIN and PREFETCH_LINES > 0:  # no launch writes the weight
            lines = tl.minimum(k_start + tl.arange(0, PREFETCH_LINES) * LINE, k_end - 1)
            prefetch_l2(w_ptr + n_rows[:, None] * stride_wn + lines[None, :])
        tl.extra.cuda.gdc_wait()
    if NORM:  # each row's 1 / rms over the whole row, in rms_norm_triton's order
        store_end = tl.where(pid_n == 0, k_end, 0)  # the first feature tile stores the rows
        dtype = x_ptr.dtype.element_ty
        rstd0 = rms_row_rstd(x_ptr, r_ptr, eps, NORM_K, NORM_LANES, HAS_RESIDUAL, dtype)
        if ROWS > 1:
            rstd1 = rms_row_rstd(
                x_ptr + stride_xm, r_ptr + stride_rm, eps, NORM_K, NORM_LANES, HAS_RESIDUAL, dtype
            )

    acc0 = _new_acc(BLOCK_N, WFMT)
    if ROWS > 1:
        acc1 = _new_acc(BLOCK_N, WFMT)
    if ROWS > 2:
        acc2 = _new_acc(BLOCK_N, WFMT)
    if ROWS > 3:
        acc3 = _new_acc(BLOCK_N, WFMT)
    if ROWS > 4:
        acc4 = _new_acc(BLOCK_N, WFMT)
    if ROWS > 5:
        acc5 = _new_acc(BLOCK_N, WFMT)
    if ROWS > 6:
        acc6 = _new_acc(BLOCK_N, WFMT)
    if ROWS > 7:
        acc7 = _new_acc(BLOCK_N, WFMT)

    for k0 in tl.range(k_start, k_start + split_len, CHUNKS * _LANES, num_stages=NUM_STAGES):
        for c in tl.static_range(CHUNKS):
            kk = tl.multiple_of(k0 + c * _LANES, _LANES)  # K ranges are whole 64-lane chunks
            w = _weight_chunk(
                w_tile,
                s_rows,
                row_scale,
                kk,
                lanes,
                k_end,
                K,
                x_ptr.dtype.element_ty,
                WFMT,
                GROUP,
                EVEN_K,
                HALF_DEQUANT,
            )
            if NORM:
                acc0 = _normed_row_fma(
                    acc0, w, 0, rstd0, x_ptr, stride_xm, r_ptr, stride_rm, nw_ptr, ro_ptr,
                    no_ptr, weight_offset, store_end, kk, lanes, k_end, NORM_K, BLOCK_N,
                    EVEN_K, HAS_RESIDUAL, HAS_OFFSET, WRITE_NORMED,
                )  # fmt: skip
                if ROWS > 1:
                    acc1 = _normed_row_fma(
                        acc1, w, 1, rstd1, x_ptr, stride_xm, r_ptr, stride_rm, nw_ptr, ro_ptr,
                        no_ptr, weight_offset, store_end, kk, lanes, k_end, NORM_K, BLOCK_N,
                        EVEN_K, HAS_RESIDUAL, HAS_OFFSET, WRITE_NORMED,
                    )  # fmt: skip
            else:
                acc0 = _row_fma(acc0, w, x_ptr, kk, lanes, k_end, BLOCK_N, EVEN_K)
                if ROWS > 1:
                    acc1 = _row_fma(acc1, w, x_ptr + stride_xm, kk, lanes, k_end, BLOCK_N, EVEN_K)
                if ROWS > 2:
                    acc2 = _row_fma(
                        acc2, w, x_ptr + 2 * stride_xm, kk, lanes, k_end, BLOCK_N, EVEN_K
                    )
                if ROWS > 3:
                    acc3 = _row_fma(
                        acc3, w, x_ptr + 3 * stride_xm, kk, lanes, k_end, BLOCK_N, EVEN_K
                    )
                if ROWS > 4:
                    acc4 = _row_fma(
                        acc4, w, x_ptr + 4 * stride_xm, kk, lanes, k_end, BLOCK_N, EVEN_K
                    )
                if ROWS > 5:
                    acc5 = _row_fma(
                        acc5, w, x_ptr + 5 * stride_xm, kk, lanes, k_end, BLOCK_N, EVEN_K
                    )
                if ROWS > 6:
                    acc6 = _row_fma(
                        acc6, w, x_ptr + 6 * stride_xm, kk, lanes, k_end, BLOCK_N, EVEN_K
                    )
                if ROWS > 7:
                    acc7 = _row_fma(
                        acc7, w, x_ptr + 7 * stride_xm, kk, lanes, k_end, BLOCK_N, EVEN_K
                    )

    if GDC == 2:  # RELEASE_AT["loop"]: the weight is streamed; only the stores are left
        tl.extra.cuda.gdc_launch_dependents()
    bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + n_rows).to(tl.float32)
    y0 = _store_row(acc0, bias, out0, n_offs, n_mask, BLOCK_N, HAS_BIAS, WFMT, GATED)
    if CONV:
        _conv_epilogue(
            y0, 0, n_offs, n_mask, conv_c, cw_ptr, stride_cw, cs_ptr, stride_css, stride_csc,
            slot_ptr, co_ptr, stride_com, CONV_WIDTH, CONV_WIDTH_PAD, CONV_SILU,
        )  # fmt: skip
    if ROWS > 1:
        y1 = _store_row(
            acc1, bias, out0 + stride_om, n_offs, n_mask, BLOCK_N, HAS_BIAS, WFMT, GATED
        )
        if CONV:
            _conv_epilogue(
                y1, 1, n_offs, n_mask, conv_c, cw_ptr, stride_cw, cs_ptr, stride_css,
                stride_csc, slot_ptr, co_ptr, stride_com, CONV_WIDTH, CONV_WIDTH_PAD, CONV_SILU,
            )  # fmt: skip
    if ROWS > 2:
        _store_row(acc2, bias, out0 + 2 * stride_om, n_offs, n_mask, BLOCK_N, HAS_BIAS, WFMT, GATED)
    if ROWS > 3:
        _store_row(acc3, bias, out0 + 3 * stride_om, n_offs, n_mask, BLOCK_N, HAS_BIAS, WFMT, GATED)
    if ROWS > 4:
        _store_row(acc4, bias, out0 + 4 * stride_om, n_offs, n_mask, BLOCK_N, HAS_BIAS, WFMT, GATED)
    if ROWS > 5:
        _store_row(acc5, bias, out0 + 5 * stride_om, n_offs, n_mask, BLOCK_N, HAS_BIAS, WFMT, GATED)
    if ROWS > 6:
        _store_row(acc6, bias, out0 + 6 * stride_om, n_offs, n_mask, BLOCK_N, HAS_BIAS, WFMT, GATED)
    if ROWS > 7:
        _store_row(acc7, bias, out0 + 7 * stride_om, n_offs, n_mask, BLOCK_N, HAS_BIAS, WFMT, GATED)
    if ROUTE:
        _route_epilogue(
            out0, stride_om, counter_ptr, rw_ptr, stride_rwm, rid_ptr, stride_ridm, route_experts,
            ROWS, ROUTE_TOP_K, ROUTE_K_PAD, ROUTE_E_PAD, ROUTE_RENORMALIZE, ROUTE_SHARED,
            ROUTE_PICKS,
        )  # fmt: skip


@triton.jit
def _sum_partials(
    part, bias_at, mask, stride_ws_split, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr
):
    """((p_0 + p_1) + ...) + p_{S-1} (+ bias), partials in order, in float32."""
    y = tl.load(part, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        y = y + tl.load(part + s * stride_ws_split, mask=mask, other=0.0)
    if HAS_BIAS:
        y = y + tl.load(bias_at, mask=mask, other=0.0).to(tl.float32)
    return y


@triton.jit
def _split_k_reduce_kernel(
    ws_ptr,
    b_ptr,
    out_ptr,
    N,
    stride_ws_row,
    stride_ws_split,
    stride_om,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
):
    """out[row, n] = round(((p_0 + p_1) + ...) + p_{S-1} (+ bias)), partials in order.
    GATED: the workspace rows hold [gate | up] (2N wide); out = silu(gate) * up, each
    sum rounded to the output dtype first, as the plain GEMV's store rounds it."""
    row = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    part = ws_ptr + row * stride_ws_row + cols
    y = _sum_partials(part, b_ptr + cols, mask, stride_ws_split, SPLIT_K, HAS_BIAS)
    dtype = out_ptr.dtype.element_ty
    if GATED:
        up = _sum_partials(part + N, b_ptr + N + cols, mask, stride_ws_split, SPLIT_K, HAS_BIAS)
        y = silu_mul(y.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype)
    tl.store(out_ptr + row * stride_om + cols, y.to(dtype), mask=mask)


def gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    plan: GemvPlan | None = None,
) -> torch.Tensor:
    """y = x @ weight^T (+ bias) as [M, N] in x's dtype, for 0 <= M <= GEMV_MAX_M.

    x: [M, K], last dim contiguous (rows may be strided); weight: contiguous [N, K] of
    x's dtype (nn.Linear layout); bias: [N] of x's dtype or None. `plan` overrides
    `choose_gemv_plan`.
    """
    _check_args(x, weight, bias)
    m, k = x.shape
    if m > GEMV_MAX_M:
        raise ValueError(f"x: {m} rows exceed GEMV_MAX_M={GEMV_MAX_M}; use F.linear")
    if plan is None:
        plan = choose_gemv_plan(max(m, 1), weight.shape[0], k, x.dtype)
    out = torch.empty((m, weight.shape[0]), dtype=x.dtype, device=x.device)
    return launch_gemv(x, weight, bias, out, plan)


def gemv_silu_and_mul_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    plan: GemvPlan | None = None,
) -> torch.Tensor:
    """silu_and_mul(gemv_triton(x, weight, bias)) in one launch: [M, I] in x's dtype.

    weight: the merged [gate; up] projection, [2I, K] (bias [2I]); otherwise as
    gemv_triton. Bitwise equal to the two launches with the same plan (or any plan of
    the same split_k): each sum is the GEMV's, rounded to x's dtype, then the activation
    kernel's arithmetic (activation_triton.silu_mul) runs once per output element. The
    plan is the [2I, K] GEMV's (`choose_gemv_plan`): its block_n / 2 features per
    program read block_n weight rows, so programs and bytes per program are the gate_up
    GEMV's. Allocates only the output (split_k = 1) or, with split_k > 1, the GEMV's
    float32 workspace too.
    """
    _check_args(x, weight, bias)
    m, k = x.shape
    if m > GEMV_MAX_M:
        raise ValueError(f"x: {m} rows exceed GEMV_MAX_M={GEMV_MAX_M}; use F.linear")
    if weight.shape[0] % 2:
        raise ValueError(f"weight: expected [gate; up] rows (an even count), got {weight.shape[0]}")
    if plan is None:
        plan = choose_gemv_plan(max(m, 1), weight.shape[0], k, x.dtype)
    out = torch.empty((m, weight.shape[0] // 2), dtype=x.dtype, device=x.device)
    return launch_gemv(x, weight, bias, out, plan, silu_and_mul=True)


@dataclasses.dataclass(frozen=True)
class NormPrologue:
    """RMSNorm(x + residual) * (weight_offset + weight) applied to the GEMV's input rows
    inside its launch (`launch_gemv(norm=...)`). residual_out receives x + residual
    (with a residual) and normed_out the normed rows (when given): fresh [M, K] tensors."""

    weight: torch.Tensor
    eps: float
    weight_offset: float
    residual: torch.Tensor | None
    residual_out: torch.Tensor | None
    normed_out: torch.Tensor | None


def _norm_args(x: torch.Tensor, norm: NormPrologue | None) -> dict:
    """The kernel's norm arguments (placeholder pointers when there is no prologue)."""
    k = x.shape[1]
    res = norm.residual if norm is not None else None
    return dict(
        r_ptr=res if res is not None else x,
        nw_ptr=norm.weight if norm is not None else x,
        ro_ptr=norm.residual_out if res is not None else x,
        no_ptr=norm.normed_out if norm is not None and norm.normed_out is not None else x,
        stride_rm=res.stride(0) if res is not None else 0,
        eps=float(norm.eps) if norm is not None else 0.0,
        weight_offset=float(norm.weight_offset) if norm is not None else 0.0,
        NORM=norm is not None,
        NORM_K=k if norm is not None else 0,
        NORM_LANES=sq_lanes(k) if norm is not None else 1,
        HAS_RESIDUAL=res is not None,
        HAS_OFFSET=norm is not None and bool(norm.weight_offset),
        WRITE_NORMED=norm is not None and norm.normed_out is not None,
    )


def rms_norm_gemv_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    weight_offset: float = 0.0,
    silu_and_mul: bool = False,
    write_normed: bool = False,
    plan: GemvPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """RMSNorm (with the residual add) and the GEMV that reads its output, in one launch
    (two with a split-K plan): returns (y, x + residual or None, the normed rows or None).

    Bitwise rms_norm_triton(x, norm_weight, eps, residual, weight_offset) followed by
    gemv_triton (or, with `silu_and_mul`, gemv_silu_and_mul_triton) on its output with
    the same plan: every program recomputes each row's 1 / rms with the norm kernel's
    helpers (whole row, its fixed order), then normalizes each 64-column chunk as the
    norm kernel does before the chunk's multiply-adds. The programs of the first
    feature tile store x + residual and, with `write_normed`, the normed rows (for a
    second consumer), into fresh tensors: nothing is written over an input.

    x, residual: [M, K] of one half/single dtype, M <= NORM_GEMV_MAX_M, last dim
    contiguous; norm_weight [K] of x's dtype; weight, bias as gemv_triton's (a [gate;
    up] weight with `silu_and_mul`); `plan` defaults to the GEMV's own choice.
    """
    _check_args(x, weight, bias)
    _check_norm_args(x, residual, norm_weight, weight)
    if silu_and_mul and weight.shape[0] % 2:
        raise ValueError(f"weight: expected [gate; up] rows (an even count), got {weight.shape[0]}")
    if plan is None:
        plan = choose_gemv_plan(max(x.shape[0], 1), weight.shape[0], x.shape[1], x.dtype)
    width = weight.shape[0] // 2 if silu_and_mul else weight.shape[0]
    out = torch.empty((x.shape[0], width), dtype=x.dtype, device=x.device)
    norm = _norm_prologue(x, residual, norm_weight, eps, weight_offset, write_normed)
    launch_gemv(x, weight, bias, out, plan, silu_and_mul=silu_and_mul, norm=norm)
    return out, norm.residual_out, norm.normed_out


def _norm_prologue(x, residual, norm_weight, eps, weight_offset, write_normed) -> NormPrologue:
    """The norm prologue with fresh [M, K] outputs for the new residual and normed rows."""
    new_rows = dict(size=tuple(x.shape), dtype=x.dtype, device=x.device)
    return NormPrologue(
        weight=norm_weight,
        eps=eps,
        weight_offset=weight_offset,
        residual=residual,
        residual_out=torch.empty(**new_rows) if residual is not None else None,
        normed_out=torch.empty(**new_rows) if write_normed else None,
    )


def rms_norm_gemv_route_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    top_k: int,
    renormalize: bool,
    shared_expert_weight: str | None = None,
    weight_offset: float = 0.0,
    write_normed: bool = False,
    plan: GemvPlan | None = None,
    picks_per_round: int = PICKS_PER_ROUND,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """rms_norm_gemv_triton with gemv_route_triton's router: returns (logits, x + residual
    or None, normed rows or None, weights, ids), bitwise rms_norm_gemv_triton followed by
    softmax_topk_triton on its logits; one launch where gemv_route_triton fuses."""
    _check_norm_args(x, residual, norm_weight, weight)
    norm = _norm_prologue(x, residual, norm_weight, eps, weight_offset, write_normed)
    logits, weights, ids = gemv_route_triton(
        x, weight, bias, top_k=top_k, renormalize=renormalize,
        shared_expert_weight=shared_expert_weight, plan=plan, picks_per_round=picks_per_round,
        norm=norm,
    )  # fmt: skip
    return logits, norm.residual_out, norm.normed_out, weights, ids


def gemv_route_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    top_k: int,
    renormalize: bool,
    shared_expert_weight: str | None = None,
    plan: GemvPlan | None = None,
    picks_per_round: int = PICKS_PER_ROUND,
    norm: NormPrologue | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A MoE layer's router GEMV and softmax top-k router in one launch: returns (logits
    [M, N], weights, ids), bitwise gemv_triton (with `norm`, its prologue) followed by
    moe_router_triton.softmax_topk_triton on the logits with the same arguments. The last
    program to store its logits routes every row (ROUTE, `_route_epilogue`); where the
    plan splits K, or its warps are not the router launch's (a reduction's order could
    differ), the two launches run instead."""
    _check_args(x, weight, bias)
    m, k = x.shape
    if m > GEMV_MAX_M:
        raise ValueError(f"x: {m} rows exceed GEMV_MAX_M={GEMV_MAX_M}; use F.linear")
    if plan is None:
        plan = choose_gemv_plan(max(m, 1), weight.shape[0], k, x.dtype)
    logits = torch.empty((m, weight.shape[0]), dtype=x.dtype, device=x.device)
    num_experts = check_router_args(logits, top_k, shared_expert_weight)
    check_renormalize(renormalize)
    picks = check_picks(picks_per_round)
    fused = plan.split_k == 1 and plan.num_warps == router_num_warps(num_experts)
    if not fused or m == 0 or num_experts > MAX_EXPERTS:
        launch_gemv(x, weight, bias, logits, plan, norm=norm)
        weights, ids = softmax_topk_triton(logits, top_k, renormalize, shared_expert_weight, picks)
        return logits, weights, ids
    weights, ids = routes_out(m, top_k, shared_expert_weight, x.dtype, x.device)
    route = RouteEpilogue(
        weights=weights,
        ids=ids,
        counter=route_counter(x.device),
        num_experts=num_experts,
        top_k=top_k,
        renormalize=renormalize,
        shared=SHARED_MODES[shared_expert_weight],
        picks=picks,
    )
    launch_gemv(x, weight, bias, logits, plan, norm=norm, route=route)
    return logits, weights, ids


@dataclasses.dataclass(frozen=True)
class ConvEpilogue:
    """A depthwise causal conv's decode step on the GEMV's first C output features
    (`launch_gemv(conv=...)`): weight [C, K], the pool [num_slots, C, K-1] updated in place
    at state_indices [M] (negative: a padding row), out [M, C] the conv's output."""

    weight: torch.Tensor
    state_pool: torch.Tensor
    state_indices: torch.Tensor
    out: torch.Tensor
    silu: bool


def _conv_args(conv: ConvEpilogue | None, x: torch.Tensor) -> dict:
    """The kernel's conv arguments (placeholder pointers when there is no epilogue)."""
    if conv is None:
        return dict(
            conv_c=0, cw_ptr=x, stride_cw=0, cs_ptr=x, stride_css=0, stride_csc=0, slot_ptr=x,
            co_ptr=x, stride_com=0, CONV=False, CONV_WIDTH=1, CONV_WIDTH_PAD=1, CONV_SILU=False,
        )  # fmt: skip
    width = conv.weight.shape[1]
    return dict(
        conv_c=conv.weight.shape[0],
        cw_ptr=conv.weight,
        stride_cw=conv.weight.stride(0),
        cs_ptr=conv.state_pool,
        stride_css=conv.state_pool.stride(0),
        stride_csc=conv.state_pool.stride(1),
        slot_ptr=conv.state_indices,
        co_ptr=conv.out,
        stride_com=conv.out.stride(0),
        CONV=True,
        CONV_WIDTH=width,
        CONV_WIDTH_PAD=next_power_of_2(width),
        CONV_SILU=conv.silu,
    )


@dataclasses.dataclass(frozen=True)
class RouteEpilogue:
    """The softmax top-k router on the GEMV's outputs, the router logits
    (`launch_gemv(route=...)`): weights [M, k (+ 1)] and ids [M, k (+ 1)] as
    moe_router_triton.softmax_topk_triton returns them, for experts the first
    `num_experts` features (one more, the shared gate, with `shared`); counter: the
    launch's arrival counter (`route_counter`)."""

    weights: torch.Tensor
    ids: torch.Tensor
    counter: torch.Tensor
    num_experts: int
    top_k: int
    renormalize: bool
    shared: int
    picks: int


def route_counter(device: torch.device) -> torch.Tensor:
    """The route epilogue's arrival counter: one int32 per device (one launch routes)."""
    return arrival_counters("router_gemv", device, 1, 1).view(1)


def _route_args(route: RouteEpilogue | None, x: torch.Tensor) -> dict:
    """The kernel's route arguments (placeholder pointers when there is no epilogue)."""
    if route is None:
        return dict(
            counter_ptr=x, rw_ptr=x, stride_rwm=0, rid_ptr=x, stride_ridm=0, route_experts=0
        )
    return dict(
        counter_ptr=route.counter,
        rw_ptr=route.weights,
        stride_rwm=route.weights.stride(0),
        rid_ptr=route.ids,
        stride_ridm=route.ids.stride(0),
        route_experts=route.num_experts,
        ROUTE=True,
        ROUTE_TOP_K=route.top_k,
        ROUTE_K_PAD=next_power_of_2(route.weights.shape[1]),
        ROUTE_E_PAD=next_power_of_2(route.num_experts),
        ROUTE_RENORMALIZE=route.renormalize,
        ROUTE_SHARED=route.shared,
        ROUTE_PICKS=route.picks,
    )


def gemv_conv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_weight: torch.Tensor,
    conv_state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    activation: str | None = "silu",
    plan: GemvPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """gemv_triton, then causal_conv1d_update_triton on the first C = conv_weight.shape[0]
    columns of its output, in one launch: returns (y, the conv's output [M, C]); the
    pool is updated in place as the conv launch does.

    Gated DeltaNet's decode in_proj: its first C output features are the conv channels
    [q | k | v]. Each program, after storing its features' y (rounded to x's dtype),
    runs the conv launch's arithmetic on those that are conv channels
    (causal_conv1d_triton.conv1d_update_channels) for each row's slot, so y, the conv
    output and the pool are bitwise the two launches'. A split-K plan keeps them two
    launches (its sums are complete only in the reduce launch). x: at most
    CONV_GEMV_MAX_M rows; otherwise arguments as gemv_triton's and
    causal_conv1d_update_triton's (no conv bias); slot indices in range and distinct
    among non-padding rows (not checked: no host sync).
    """
    _check_args(x, weight, bias)
    return _gemv_conv(
        x, weight, bias, conv_weight, conv_state_pool, state_indices, activation, plan, None
    )


def rms_norm_gemv_conv_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_weight: torch.Tensor,
    conv_state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    weight_offset: float = 0.0,
    activation: str | None = "silu",
    plan: GemvPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """rms_norm_gemv_triton and gemv_conv_triton's conv epilogue in one launch: returns
    (y, x + residual or None, the conv's output [M, C]), bitwise the norm + GEMV launch
    followed by the conv update launch (two launches with a split-K plan)."""
    _check_args(x, weight, bias)
    _check_norm_args(x, residual, norm_weight, weight)
    m, k = x.shape
    norm = NormPrologue(
        weight=norm_weight,
        eps=eps,
        weight_offset=weight_offset,
        residual=residual,
        residual_out=torch.empty((m, k), dtype=x.dtype, device=x.device)
        if residual is not None
        else None,
        normed_out=None,
    )
    y, conv_out = _gemv_conv(
        x, weight, bias, conv_weight, conv_state_pool, state_indices, activation, plan, norm
    )
    return y, norm.residual_out, conv_out


def _gemv_conv(
    x, weight, bias, conv_weight, conv_state_pool, state_indices, activation, plan, norm
):
    """gemv_conv_triton's work after the GEMV's own checks, with an optional norm prologue."""
    m, k = x.shape
    if m > CONV_GEMV_MAX_M:
        raise ValueError(f"x: {m} rows exceed CONV_GEMV_MAX_M={CONV_GEMV_MAX_M}")
    channels = conv_weight.shape[0] if isinstance(conv_weight, torch.Tensor) else -1
    if not 1 <= channels <= weight.shape[0]:
        raise ValueError(
            f"conv_weight: expected [C, K] with 1 <= C <= {weight.shape[0]} (the GEMV's "
            f"features), got {getattr(conv_weight, 'shape', conv_weight)}"
        )
    check_conv_update_args(
        x, m, channels, conv_weight, None, conv_state_pool, state_indices, activation
    )
    if plan is None:
        plan = choose_gemv_plan(max(m, 1), weight.shape[0], k, x.dtype)
    out = torch.empty((m, weight.shape[0]), dtype=x.dtype, device=x.device)
    if plan.split_k > 1:  # the GEMV (+ norm) launches, then the conv launch
        launch_gemv(x, weight, bias, out, plan, norm=norm)
        conv_out = causal_conv1d_update_triton(
            out[:, :channels], conv_weight, None, conv_state_pool, state_indices, activation
        )
        return out, conv_out
    conv = ConvEpilogue(
        weight=conv_weight,
        state_pool=conv_state_pool,
        state_indices=state_indices,
        out=torch.empty((m, channels), dtype=x.dtype, device=x.device),
        silu=CONV_ACTIVATIONS[activation],
    )
    launch_gemv(x, weight, bias, out, plan, norm=norm, conv=conv)
    return out, conv.out


def _check_norm_args(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, weight: torch.Tensor
) -> None:
    m, k = x.shape
    if m > NORM_GEMV_MAX_M:
        raise ValueError(f"x: {m} rows exceed NORM_GEMV_MAX_M={NORM_GEMV_MAX_M}")
    if not 1 <= k <= NORM_GEMV_MAX_K:
        raise ValueError(f"x: K={k} is outside the fused norm's [1, {NORM_GEMV_MAX_K}]")
    if weight.shape[0] == 0:  # no program would write the residual
        raise ValueError("weight: needs at least one row (output feature)")
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or residual.shape != x.shape:
            raise ValueError(f"residual: expected a tensor of x's shape {tuple(x.shape)}")
        if residual.dtype != x.dtype:
            raise ValueError(f"residual: dtype {residual.dtype} differs from x's {x.dtype}")
        if k > 1 and residual.stride(1) != 1:
            raise ValueError("residual: the last dim must be contiguous (stride 1)")
    if not isinstance(norm_weight, torch.Tensor) or tuple(norm_weight.shape) != (k,):
        raise ValueError(f"norm_weight: expected shape ({k},) matching x's K")
    if norm_weight.dtype != x.dtype:
        raise ValueError(f"norm_weight: dtype {norm_weight.dtype} differs from x's {x.dtype}")
    if k > 1 and norm_weight.stride(0) != 1:
        raise ValueError("norm_weight: must be contiguous")
    check_same_device(x=x, residual=residual, norm_weight=norm_weight)


def launch_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    plan: GemvPlan,
    *,
    fmt: int = FMT_PLAIN.value,
    scales: torch.Tensor | None = None,
    group: int = 0,
    silu_and_mul: bool = False,
    norm: NormPrologue | None = None,
    conv: ConvEpilogue | None = None,
    route: RouteEpilogue | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """Fills out [M, N] (any float dtype) with x @ W^T (+ bias) and returns it; W is
    `weight` stored as `fmt` with `scales` [N, K / group] (group 0: one per row). With
    `silu_and_mul`, W is [gate; up] (2N rows) and out [M, N] (x's dtype) gets
    silu(gate) * up. With `norm`, x is first RMS-normalized (NormPrologue). With `conv`
    (split_k = 1, at most 2 rows, not gated), the first C features also go through a
    conv decode step (ConvEpilogue); with `route` (split_k = 1, not gated), the last
    program routes the rows (RouteEpilogue). `pdl`: launch the GEMV (the split-K partial sums;
    not their reduce) with programmatic dependent launch; None: `uses_pdl(x)`. Callers
    check the arguments; this only launches."""
    if not isinstance(plan, GemvPlan):
        raise ValueError(f"plan: expected a GemvPlan or None, got {type(plan).__name__}")
    if conv is not None and (plan.split_k > 1 or silu_and_mul or x.shape[0] > CONV_GEMV_MAX_M):
        raise ValueError(
            f"conv: the epilogue needs split_k = 1, <= {CONV_GEMV_MAX_M} rows, no silu_and_mul"
        )
    if route is not None and (plan.split_k > 1 or silu_and_mul):
        raise ValueError("route: the epilogue needs split_k = 1 and no silu_and_mul")
    m, k = x.shape
    n = out.shape[1]
    if m == 0 or n == 0:
        return out
    width = 2 * n if silu_and_mul else n  # GEMV features (weight rows)
    # The activation's launches compile as activation_triton's (no mul-add contraction);
    # the K loop's FMAs are explicit, so its sums are the same either way. The norm
    # prologue compiles as rms_norm_triton's does, for the same reason.
    act_options = dict(enable_fp_fusion=False) if silu_and_mul else {}
    norm_options = dict(enable_fp_fusion=False) if norm is not None else {}
    # The conv and route epilogues compile as their own launches do (causal_conv1d_triton,
    # moe_router_triton).
    if conv is not None or route is not None:
        norm_options = dict(enable_fp_fusion=False)
    split_len = split_k_len(k, plan.split_k)
    gdc = uses_pdl(x) if pdl is None else pdl
    line = 128 // weight.element_size()  # elements a 128-byte line holds (plain weights)
    # With PDL, the 128-byte lines of each weight row a program asks L2 for before it waits
    # on the launch before it (KVLOOM_PDL_PREFETCH_LINES, 16: 2 KB of a bf16 row, the first
    # turns of the K loop; 0: none). Only the programs staged during that launch prefetch
    # (a few hundred): a few MB to ~20 MB, inside L2, where whole rows could evict lines
    # before their use.
    cap = envs.pdl_prefetch_lines() if gdc else 0
    lines = min(cap, next_power_of_2(triton.cdiv(split_len, line))) if cap else 0
    prefetch = dict(PREFETCH_LINES=lines, LINE=line)
    common = dict(
        **pdl_launch(gdc),
        **(prefetch if gdc else {}),
        ROWS=m,
        CHUNKS=plan.block_k // LANES,
        NUM_STAGES=plan.num_stages,
        EVEN_K=is_even_k(k, plan),
        WFMT=fmt,
        GROUP=group,
        HALF_DEQUANT=_half_dequant(x, fmt, scales, group),
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        **_norm_args(x, norm),
        **_conv_args(conv, x),
        **_route_args(route, x),
    )
    s = scales if scales is not None else weight  # placeholder pointers when absent
    b = bias if bias is not None else weight
    stride_sn = scales.stride(0) if scales is not None else 0
    if plan.split_k == 1:
        # Fused: a tile holds one gate and one up row at least (speed only, not bits).
        block_n = max(plan.block_n, 2) if silu_and_mul else plan.block_n
        _gemv_kernel[(triton.cdiv(width, block_n), 1)](
            x,
            weight,
            s,
            b,
            out,
            n,
            k,
            x.stride(0),
            weight.stride(0),
            stride_sn,
            out.stride(0),
            0,
            split_len,
            BLOCK_N=block_n,
            HAS_BIAS=bias is not None,
            GATED=silu_and_mul,
            **common,
            **{**act_options, **norm_options},
        )
        return out
    # Split-K: the plain GEMV's partial sums of all `width` features; the reduce launch
    # adds them (and applies the activation, fused).
    ws = torch.empty((plan.split_k, m, width), dtype=torch.float32, device=x.device)
    _gemv_kernel[(triton.cdiv(width, plan.block_n), plan.split_k)](
        x,
        weight,
        s,
        b,
        ws,
        width,
        k,
        x.stride(0),
        weight.stride(0),
        stride_sn,
        width,
        m * width,
        split_len,
        BLOCK_N=plan.block_n,
        HAS_BIAS=False,
        GATED=False,
        **common,
        **norm_options,
    )
    _split_k_reduce_kernel[(triton.cdiv(n, _REDUCE_BLOCK), m)](
        ws,
        b,
        out,
        n,
        width,
        m * width,
        out.stride(0),
        SPLIT_K=plan.split_k,
        BLOCK=_REDUCE_BLOCK,
        HAS_BIAS=bias is not None,
        GATED=silu_and_mul,
        num_warps=4,
        **act_options,
    )
    return out


def _half_dequant(x: torch.Tensor, fmt: int, scales: torch.Tensor | None, group: int) -> bool:
    """Whether int4 weights dequantize in 16-bit arithmetic (_weight_chunk): grouped bf16
    or fp16 scales of x's dtype, compiled (Triton's CPU interpreter gets 16-bit float
    arithmetic wrong, so interpreted launches keep the float32 route to the same bits)."""
    return (
        fmt == FMT_INT4.value
        and group != 0
        and scales is not None
        and x.dtype in (torch.bfloat16, torch.float16)
        and scales.dtype == x.dtype
        and not is_interpreted(_gemv_kernel)
    )


def _check_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D [M, K] tensor, got shape {tuple(x.shape)}")
    check_dtype("x", x)
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError("x: the last dim must be contiguous (stride 1)")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"weight: expected shape [N, {x.shape[1]}] (x's K), got {tuple(weight.shape)}"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"weight: dtype {weight.dtype} differs from x's {x.dtype}")
    if not weight.is_contiguous():
        raise ValueError("weight: must be contiguous [N, K]")
    if bias is not None:
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias: expected shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        if bias.shape[0] > 1 and bias.stride(0) != 1:
            raise ValueError("bias: must be contiguous")
        if bias.dtype != x.dtype:
            raise ValueError(f"bias: dtype {bias.dtype} differs from x's {x.dtype}")
    check_same_device(x=x, weight=weight, bias=bias)
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"x: the Triton kernel needs a CUDA tensor, got device {x.device}")
