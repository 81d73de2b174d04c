"""FP8 GEMM: the Triton kernels (per-token-group activation quantization, then an e4m3
GEMM with group scales, on Hopper's FP8 tensor cores when compiled).

Semantics are `fp8_gemm.fp8_linear_ref`'s (read its docstring). Two launches:

1. `_quant_tile_kernel`, one program per tile of tokens x whole groups (`QuantPlan`,
   about QUANT_TILE elements, read once with vector loads): each group's max |x| (exact),
   scale = max(amax, 1e-10) / 448, x / scale correctly rounded (`div_rn`), clamped, cast
   to e4m3 (round to nearest even): bitwise the reference's quantized activations and
   scales, in any plan. Groups wider than MAX_TILE_GROUP take `_quant_wide_group_kernel`
   (one program per (token, group), two chunked passes). Issue 22: the chunked kernel
   for every group (one 128-element program per group, 2-byte loads, two passes) took
   0.13-0.29 ms at 4,096 tokens on the H200, about the GEMM's own time.
2. `_fp8_gemm_kernel`, one program per output tile (BLOCK_N weight rows x BLOCK_M
   tokens): for each BLOCK_K tile of K, the e4m3 dot (exact products, float32 sums) is
   scaled by x_s[t, g] * w_s[n, g] (g = the tile's group) and added to a float32
   accumulator; the bias is added in float32 and the result rounded once.

Plans (`Fp8GemmPlan`, picked by `choose_fp8_gemm_plan(num_tokens)`) vary BLOCK_M, BLOCK_N,
warps, pipeline stages and the order programs start in; nothing else. Why every plan gives
bitwise the same output (invariant 7): an output element is the result of one sequence of
float operations, and no plan field changes that sequence, only where and when it runs.

- BLOCK_K is `gemm_block_k(group_size, K)`, a function of the shape only, so every plan
  walks the same K tiles in ascending order and adds `part * w_s * x_s` to the element's
  float32 accumulator once per tile, in K order.
- `part` is the element's dot over one K tile. Weight rows stay in the dot's M slot and
  tokens in its N slot, and plans keep BLOCK_N a multiple of 64, BLOCK_M a multiple of 16
  and warps a multiple of 4 (checked), the bounds inside which Triton's choice of MMA
  instruction depends only on the dtypes, BLOCK_K, `max_num_imprecise_acc` and the GPU.
  Every plan thus issues the same instruction, and Triton chains its MMAs over a K tile
  in ascending K order into the element's zero-started float32 part, whatever the tile
  and warps. Seen compiling for sm_90 with Triton 3.9 (every plan): with
  `max_num_imprecise_acc=0` Triton refuses wgmma for e4m3 (its float32 promotion needs
  at least 32 products per MMA) and uses mma.sync m16n8k16 on operands converted to fp16
  (exactly: every e4m3 value is an fp16), BLOCK_K / 16 MMAs per tile. Tile shape and
  warps only decide which elements a program holds and which threads hold them; stages
  only how early loads are issued; the program order only which tile starts first.
  Interpreted, `_dot_fp8` sums the products one k at a time, whatever the tile.
- BLOCK_K stays 64 for 128-column groups. 128 would halve the per-tile scaling work and
  would keep invariant 7 if every plan of the shape used it, but it changes every plan's
  bits (decode too) and the FP8 MoE shares `gemm_block_k`: a change for after measuring.

`group` > 1 (prefill plans) orders programs for L2: they are numbered in bands of `group`
token tiles and walk down a band before moving to the next weight tile, so the programs
running at once share a few weight and token tiles instead of each streaming its own
weight tile. group = 1 is row-major order (weight tiles fastest): the order of the 2-D
grid this kernel used before plans.

Up to PREFILL_MIN_TOKENS tokens the plans are the tiles measured on the H200 before plans
existed: 64 weight rows x 16, 32 or 64 tokens, 4 warps, 3 stages (decode tokens pad to a
16-token tile). From there, 128 weight rows x 64 tokens on 4 warps in grouped order, the
fastest candidate measured on an H200 (docs/benchmarks/quantization.md).

A group must be whole BLOCK_K tiles, or one group per row (per-channel weights): checked.
No host sync; allocations are the quantized activations, their scales and the output
(CUDA-graph capturable).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kvloom.kernels.arg_checks_triton import (
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
    is_interpreted,
    next_power_of_2,
)
from kvloom.kernels.fp8_gemm import check_fp8_gemm_args
from kvloom.kernels.fp8_quant import FP8_DTYPE, FP8_MAX, SCALE_EPS, check_group_size

# The small plans' tiling, also the FP8 MoE's (fp8_moe_triton imports these).
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 3
MAX_QUANT_CHUNK = 1024


@dataclasses.dataclass(frozen=True)
class Fp8GemmPlan:
    """One tiling of the FP8 GEMM; it changes speed only, never results."""

    block_m: int  # tokens per program (the dot's N slot)
    block_n: int  # weight rows per program (the dot's M slot)
    warps: int
    stages: int  # software-pipelining depth of the K loop
    group: int = 1  # token tiles per band of the program order (1: row-major)

    def __post_init__(self) -> None:
        def bad(field: str, want: str) -> ValueError:
            return ValueError(f"plan.{field}: {getattr(self, field)!r} is not {want}")

        for field in ("block_m", "block_n", "warps", "stages", "group"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool):
                raise bad(field, "an int")
        # The bitwise argument of the module docstring rests on these bounds: inside them
        # Triton picks the same MMA instruction for every plan.
        if self.block_m not in (16, 32, 64, 128):
            raise bad("block_m", "one of 16, 32, 64, 128")
        if self.block_n not in (64, 128):
            raise bad("block_n", "64 or 128")
        if self.warps not in (4, 8):
            raise bad("warps", "4 or 8")
        if not 1 <= self.stages <= 6:
            raise bad("stages", "in [1, 6]")
        if not 1 <= self.group <= 64:
            raise bad("group", "in [1, 64]")

    @property
    def name(self) -> str:
        return f"m{self.block_m}n{self.block_n}w{self.warps}s{self.stages}g{self.group}"


# Decode / small launches: the tiles measured before plans existed (unchanged).
SMALL_PLANS = {m: Fp8GemmPlan(m, BLOCK_N, NUM_WARPS, NUM_STAGES) for m in (16, 32, 64)}
# Prefill: 128 weight rows x 64 tokens on 4 warps, 4 stages, grouped order for L2. The
# fastest of the candidates below at 1,024 and 4,096 tokens on every Qwen3-8B projection
# (H200, 2026-12-05, 4,096 tokens: 202-239 TFLOP/s, against 173-203 for the 64 x 64 tile
# and 142-165 for 128 x 128 on 8 warps; docs/benchmarks/quantization.md), bitwise equal
# to every plan.
PREFILL_PLAN = Fp8GemmPlan(64, 128, 4, 4, 8)
# Every plan the tests and the benchmark cover: the table `choose_fp8_gemm_plan` picks
# from, plus candidates timed beside it (a 128 x 128 tile on 8 warps, with and without
# grouped order, to measure what grouping buys).
FP8_GEMM_PLANS = (
    *SMALL_PLANS.values(),
    PREFILL_PLAN,
    Fp8GemmPlan(128, 128, 8, 4, 8),
    Fp8GemmPlan(128, 128, 8, 4, 1),
)
# From here on the prefill plan (measured best at 1,024 tokens on all four projections; at
# 256 tokens it won only on the widest). It is also above the default CUDA-graph decode
# ladder (up to 256 rows), so captured decode launches keep small plans.
PREFILL_MIN_TOKENS = 1024


def gemm_block_k(group_size: int, in_features: int) -> int:
    """The K tile: 64 when groups are whole tiles (or one group spans the row), else the
    group itself (16 or 32). Fixed by the shape, never by the token count."""
    if group_size % 64 == 0 or group_size == in_features:
        return 64
    if group_size in (16, 32):
        return group_size
    raise ValueError(f"group_size {group_size}: expected a multiple of 64, 16, 32 or the row")


def choose_fp8_gemm_plan(num_tokens: int) -> Fp8GemmPlan:
    """Below PREFILL_MIN_TOKENS the choice from before plans (a 16-token tile up to 16
    tokens, 32 up to 64, then 64); from there PREFILL_PLAN."""
    if num_tokens <= 16:
        return SMALL_PLANS[16]
    if num_tokens <= 64:
        return SMALL_PLANS[32]
    return SMALL_PLANS[64] if num_tokens < PREFILL_MIN_TOKENS else PREFILL_PLAN


@triton.jit
def _dot_fp8(a, b, acc, INTERPRETED: tl.constexpr, IMPRECISE_ACC: tl.constexpr = 0):
    """acc + a @ b in float32 for e4m3 (or half) operands. Interpreted, an explicit sum
    over k in order (the interpreter's matmul changes its order with the shapes).
    Compiled: Triton's default for e4m3 dots on sm_90 keeps the whole K range in the
    tensor cores' narrower accumulator. max_num_imprecise_acc=0 asks for float32 sums;
    Triton then leaves FP8 wgmma for mma.sync on fp16-converted operands (module
    docstring): accurate, at fp16 mma.sync rates. IMPRECISE_ACC=32 (benchmarks only, not
    a plan: it changes the bits) keeps wgmma and adds each 32-product MMA into float32."""
    if INTERPRETED:
        prod = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]
        return acc + tl.sum(prod, axis=1)
    return tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE_ACC)


MAX_BLOCK = 256  # most tokens, and most groups, one quantizer program takes


@dataclasses.dataclass(frozen=True)
class QuantPlan:
    """One tiling of the activation quantizer; it changes speed only, never results (each
    element's scale is an exact max and two correctly rounded divisions, wherever and
    with whatever neighbours it is computed)."""

    block_t: int  # tokens per program
    block_g: int  # groups per program
    warps: int

    def __post_init__(self) -> None:
        for field, top in (("block_t", MAX_BLOCK), ("block_g", MAX_BLOCK), ("warps", 16)):
            value = getattr(self, field)
            ok = isinstance(value, int) and not isinstance(value, bool)
            if not ok or not 1 <= value <= top or value & (value - 1):
                raise ValueError(f"plan.{field}: {value!r} is not a power of 2 in [1, {top}]")

    @property
    def name(self) -> str:
        return f"t{self.block_t}g{self.block_g}w{self.warps}"


# Elements one program of the tiled quantizer holds: 8 KiB of bf16 in, 16 per thread on
# 8 warps, enough bytes in flight per SM to stream at HBM rate and few enough programs
# (6,144 at 4,096 tokens x K 12,288) that block scheduling does not dominate.
QUANT_TILE = 4096
# Widest group (padded to a power of 2) the tiled quantizer holds in registers; wider
# groups (per-token scales of a very wide row) take the chunked two-pass kernel.
MAX_TILE_GROUP = 8192
# Consecutive tokens per program where the scales are column-major: one 32-byte sector
# of each group's scale column per program instead of a lone 4-byte write.
COLUMN_MAJOR_MIN_TOKENS = 8
# Mid-size launches shrink the tile (down to MIN_QUANT_TILE elements) until they have
# MIN_QUANT_PROGRAMS programs, about two per SM of an H100 / H200 (132 SMs).
MIN_QUANT_PROGRAMS = 256
MIN_QUANT_TILE = 1024


def choose_quant_plan(
    num_tokens: int, group_size: int, num_groups: int, column_major_scales: bool = False
) -> QuantPlan:
    """A tile of about QUANT_TILE elements: whole groups of one token first (contiguous
    row segments), then more tokens; column-major scales ask for 8 tokens per tile.
    Smaller tiles where that leaves SMs idle (MIN_QUANT_PROGRAMS)."""
    width = next_power_of_2(group_size)
    tokens_pow2 = next_power_of_2(max(num_tokens, 1))
    min_t = min(tokens_pow2, COLUMN_MAJOR_MIN_TOKENS) if column_major_scales else 1
    block_g = max(1, min(next_power_of_2(num_groups), QUANT_TILE // (width * min_t), MAX_BLOCK))
    block_t = max(1, min(tokens_pow2, QUANT_TILE // (width * block_g), MAX_BLOCK))

    def programs() -> int:
        return triton.cdiv(num_tokens, block_t) * triton.cdiv(num_groups, block_g)

    while programs() < MIN_QUANT_PROGRAMS and block_t * block_g * width > MIN_QUANT_TILE:
        if block_t > min_t:
            block_t //= 2
        elif block_g > 1:
            block_g //= 2
        else:
            break
    warps = min(16, max(4, block_t * block_g * width // 512))
    return QuantPlan(block_t, block_g, warps)


@triton.jit(do_not_specialize=["num_tokens"])
def _quant_tile_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    num_tokens,
    num_groups,
    stride_xt,
    stride_qt,
    stride_st,
    stride_sg,
    GROUP: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_G: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    EPS: tl.constexpr,
):
    # One [BLOCK_T, BLOCK_G, WIDTH] tile, read once: the innermost dim runs along a
    # group's contiguous columns, so loads are full-width vectors (GROUP is constexpr and
    # the row stride 16-divisible, so Triton knows the alignment).
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    lanes = tl.arange(0, WIDTH)
    tok64 = tokens.to(tl.int64)
    cols = groups[None, :, None] * GROUP + lanes[None, None, :]
    ok = (tokens < num_tokens)[:, None, None] & (groups < num_groups)[None, :, None]
    if WIDTH != GROUP:  # a group size that is not a power of 2 pads its lanes
        ok = ok & (lanes < GROUP)[None, None, :]
    x = tl.load(x_ptr + tok64[:, None, None] * stride_xt + cols, mask=ok, other=0.0)
    x = x.to(tl.float32)
    # Correctly rounded divisions (div_rn): a constexpr divisor may otherwise compile to
    # an approximate one, 1 ulp off torch's, which flips e4m3 roundings at boundaries.
    peak = tl.maximum(tl.max(tl.abs(x), axis=2), EPS)
    scale = tl.math.div_rn(peak, tl.zeros_like(peak) + FP8_MAX_C)
    q = tl.math.div_rn(x, tl.zeros_like(x) + scale[:, :, None])
    q = tl.minimum(tl.maximum(q, -FP8_MAX_C), FP8_MAX_C)
    q_ptrs = q_ptr + tok64[:, None, None] * stride_qt + cols
    tl.store(q_ptrs, q.to(q_ptr.dtype.element_ty), mask=ok)
    s_ptrs = s_ptr + tok64[:, None] * stride_st + groups[None, :].to(tl.int64) * stride_sg
    s_ok = (tokens < num_tokens)[:, None] & (groups < num_groups)[None, :]
    tl.store(s_ptrs, scale, mask=s_ok)


@triton.jit
def _quant_wide_group_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    group_size,
    stride_xt,
    stride_qt,
    stride_st,
    stride_sg,
    CHUNK: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    EPS: tl.constexpr,
):
    # One program per (token, group), the group walked in CHUNK-wide pieces twice (max,
    # then quantize): for groups too wide for one register tile.
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    start = group * group_size
    offs = tl.arange(0, CHUNK)
    amax = tl.zeros([CHUNK], dtype=tl.float32)
    for c in range(0, group_size, CHUNK):
        cols = start + c + offs
        x = tl.load(x_ptr + row * stride_xt + cols, mask=(c + offs) < group_size, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    peak = tl.maximum(tl.max(amax, axis=0), EPS)
    scale = tl.math.div_rn(peak, tl.zeros_like(peak) + FP8_MAX_C)  # div_rn: tile kernel
    for c in range(0, group_size, CHUNK):
        cols = start + c + offs
        ok = (c + offs) < group_size
        x = tl.load(x_ptr + row * stride_xt + cols, mask=ok, other=0.0).to(tl.float32)
        q = tl.math.div_rn(x, tl.zeros_like(x) + scale)
        q = tl.minimum(tl.maximum(q, -FP8_MAX_C), FP8_MAX_C)
        tl.store(q_ptr + row * stride_qt + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_st + group.to(tl.int64) * stride_sg, scale)


def _launch_quant_tiles(x, x_q, x_s, group_size: int, plan: QuantPlan) -> None:
    t, k = x.shape
    groups = k // group_size
    grid = (triton.cdiv(t, plan.block_t), triton.cdiv(groups, plan.block_g))
    _quant_tile_kernel[grid](
        x,
        x_q,
        x_s,
        t,
        groups,
        x.stride(0),
        x_q.stride(0),
        x_s.stride(0),
        x_s.stride(1),
        GROUP=group_size,
        WIDTH=next_power_of_2(group_size),
        BLOCK_T=plan.block_t,
        BLOCK_G=plan.block_g,
        FP8_MAX_C=FP8_MAX,
        EPS=SCALE_EPS,
        num_warps=plan.warps,
    )


def _launch_quant_wide_groups(x, x_q, x_s, group_size: int) -> None:
    """The chunked kernel, one program per (token, group). Also the benchmark's baseline
    (benchmarks/quant_moe_plans.py --act-quant): before issue 22 every group took it."""
    t, k = x.shape
    _quant_wide_group_kernel[(t, k // group_size)](
        x,
        x_q,
        x_s,
        group_size,
        x.stride(0),
        x_q.stride(0),
        x_s.stride(0),
        x_s.stride(1),
        CHUNK=min(MAX_QUANT_CHUNK, next_power_of_2(group_size)),
        FP8_MAX_C=FP8_MAX,
        EPS=SCALE_EPS,
    )


def per_token_group_quant_fp8_triton(
    x: torch.Tensor,
    group_size: int,
    column_major_scales: bool = False,
    *,
    plan: QuantPlan | None = None,
):
    """x [T, K] -> (x_q [T, K] e4m3, x_s [T, K / group] float32), bitwise the reference's,
    in one launch. `column_major_scales`: x_s with strides (1, T) (same values), the
    layout cuBLAS's 1x128 blockwise scaling reads (kernels/fp8_gemm_dispatch.py), written
    in place (no transpose). `plan` overrides `choose_quant_plan` (same bits); groups
    wider than MAX_TILE_GROUP take the chunked kernel and ignore it."""
    if x.dim() != 2:
        raise ValueError(f"x: expected [T, K], got shape {list(x.shape)}")
    check_group_size(group_size, x.shape[1])
    check_last_dim_contiguous("x", x)
    if plan is not None and not isinstance(plan, QuantPlan):
        raise ValueError(f"plan: expected a QuantPlan or None, got {plan!r}")
    t, k = x.shape
    x_q = torch.empty((t, k), dtype=FP8_DTYPE, device=x.device)
    groups = k // group_size
    if column_major_scales:
        x_s = torch.empty((groups, t), dtype=torch.float32, device=x.device).t()
    else:
        x_s = torch.empty((t, groups), dtype=torch.float32, device=x.device)
    if t == 0 or k == 0:
        return x_q, x_s
    if next_power_of_2(group_size) > MAX_TILE_GROUP:
        _launch_quant_wide_groups(x, x_q, x_s, group_size)
    else:
        plan = plan or choose_quant_plan(t, group_size, groups, column_major_scales)
        _launch_quant_tiles(x, x_q, x_s, group_size, plan)
    return x_q, x_s


@triton.jit(do_not_specialize=["num_tokens"])
def _fp8_gemm_kernel(
    xq_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    num_tokens,
    out_features,
    in_features,
    group_size,
    stride_xq,
    stride_xs,
    stride_wn,
    stride_ws,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    INTERPRETED: tl.constexpr,
    IMPRECISE_ACC: tl.constexpr,
):
    # Program order (changes speed only): bands of GROUP token tiles, each walked token
    # tile first, weight tile second; the last band may be narrower.
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(out_features, BLOCK_N)
    per_band = GROUP * tiles_n
    first_m = (pid // per_band) * GROUP
    band_m = tl.minimum(tl.cdiv(num_tokens, BLOCK_M) - first_m, GROUP)
    tile_m = first_m + (pid % per_band) % band_m
    tile_n = (pid % per_band) // band_m

    rows = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < out_features
    tok_ok = tokens < num_tokens
    rows64 = rows.to(tl.int64)
    tok64 = tokens.to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < in_features
        x = tl.load(
            xq_ptr + tok64[:, None] * stride_xq + kk[None, :],
            mask=tok_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + rows64[:, None] * stride_wn + kk[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        g = k0 // group_size
        x_s = tl.load(xs_ptr + tok64 * stride_xs + g, mask=tok_ok, other=0.0)
        w_s = tl.load(ws_ptr + rows64 * stride_ws + g, mask=row_ok, other=0.0)
        # Weight rows in the dot's M slot, tokens in its N slot, in every plan (the
        # bitwise argument of the module docstring rests on it).
        zero = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        part = _dot_fp8(w, tl.trans(x), zero, INTERPRETED, IMPRECISE_ACC)
        acc += part * w_s[:, None] * x_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + tok64[None, :] * stride_om + rows[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & tok_ok[None, :])


def _resolve_plan(num_tokens: int, plan: Fp8GemmPlan | None, block_m: int | None) -> Fp8GemmPlan:
    if plan is not None and block_m is not None:
        raise ValueError("pass plan or block_m, not both")
    if block_m is not None:
        if block_m not in SMALL_PLANS:
            raise ValueError(
                f"block_m: expected one of {tuple(SMALL_PLANS)} or None, got {block_m!r}"
            )
        return SMALL_PLANS[block_m]
    if plan is None:
        return choose_fp8_gemm_plan(num_tokens)
    if not isinstance(plan, Fp8GemmPlan):
        raise ValueError(f"plan: expected an Fp8GemmPlan or None, got {plan!r}")
    return plan


def fp8_matmul_triton(
    x_q,
    x_s,
    w_q,
    w_s,
    group_size,
    bias=None,
    out_dtype=torch.float32,
    *,
    plan: Fp8GemmPlan | None = None,
    block_m: int | None = None,
    imprecise_acc: int = 0,
) -> torch.Tensor:
    """[T, N] in `out_dtype` from quantized activations (x_q [T, K], x_s [T, K / g]).
    `plan` overrides `choose_fp8_gemm_plan`; `block_m` (16, 32, 64) is short for the
    small plan with that token tile. Every plan gives bitwise the same output.
    `imprecise_acc` (0 or 32) is for benchmarks: Triton's max_num_imprecise_acc
    (`_dot_fp8`), which changes the results."""
    if imprecise_acc not in (0, 32):
        raise ValueError(f"imprecise_acc: expected 0 or 32, got {imprecise_acc!r}")
    m, k = x_q.shape
    n = w_q.shape[0]
    block_k = gemm_block_k(group_size, k)
    plan = _resolve_plan(m, plan, block_m)
    out = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return out
    grid = (triton.cdiv(n, plan.block_n) * triton.cdiv(m, plan.block_m),)
    _fp8_gemm_kernel[grid](
        x_q,
        x_s,
        w_q,
        w_s,
        bias if bias is not None else w_s,
        out,
        m,
        n,
        k,
        group_size,
        x_q.stride(0),
        x_s.stride(0),
        w_q.stride(0),
        w_s.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        BLOCK_K=block_k,
        GROUP=plan.group,
        INTERPRETED=is_interpreted(_fp8_gemm_kernel),
        IMPRECISE_ACC=imprecise_acc,
        num_warps=plan.warps,
        num_stages=plan.stages,
    )
    return out


def fp8_linear_triton(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    plan: Fp8GemmPlan | None = None,
    block_m: int | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N] (dynamic activation scales; a static input_scale takes the
    reference). Every `plan` (or `block_m`) gives bitwise the same output."""
    n, k = check_fp8_gemm_args(x, w_q, w_s, group_size)
    check_dtype("x", x)
    check_last_dim_contiguous("weight", w_q)
    check_same_device(x=x, weight=w_q, weight_scale=w_s, bias=bias)
    flat = x.reshape(-1, k)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    plan = _resolve_plan(flat.shape[0], plan, block_m)  # bad arguments fail before a launch
    x_q, x_s = per_token_group_quant_fp8_triton(flat, group_size)
    out = fp8_matmul_triton(x_q, x_s, w_q, w_s, group_size, bias, out_dtype or x.dtype, plan=plan)
    return out.view(*x.shape[:-1], n)
