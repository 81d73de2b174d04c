"""Batch-invariant Triton kernels for the deterministic mode (`deterministic=True`).

Same semantics as the references in `batch_invariant.py`. Each output element gets one
summation order whatever else is in the launch:

* `matmul_triton`: y = x W^T (+ bias), no split-K: a program owns an output tile and walks
  K from 0 upwards in BLOCK_K steps into a float32 accumulator, so a row's bits do not
  depend on its neighbours. One tile shape (`MATMUL_PLAN`) for every M, except on Hopper,
  where the tile is picked by M from `SM90_MATMUL_PLANS`: every wgmma tile measured there
  gives the same bits (invariant 7), and the larger ones are faster. (cuBLAS picks split-K
  by M, which changes the order; the GEMV fast path sums in another order again.)
* `serial_causal_conv1d_triton` / `serial_gated_delta_rule_triton`: the linear-attention
  conv and recurrence token by token, one program per (sequence, channel or state-column
  block) looping over that sequence's tokens with the same per-token arithmetic. Prefill
  chunks and decode steps run this one loop body, so a token's numbers do not depend on how
  its request was chunked, cached or preempted. In the deterministic mode the recurrent
  state is rounded to the pool's dtype after every token, exactly as if it had been stored
  each step; the default mode's mixed steps (`round_every_token=False`) round it once, when
  stored, as the chunked kernels do, run the recurrence on fewer warps
  (`serial_recurrence_tiling`) and the conv over blocks of packed tokens (`token_parallel`:
  the same per-token arithmetic, no chain of a long row's token steps).

No host synchronisation and grids from shapes only: CUDA graphs capture them.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from kvloom.contracts import envs
from kvloom.kernels.arg_checks_triton import is_interpreted, next_power_of_2
from kvloom.kernels.l2norm import L2NORM_EPS

# The one matmul tile (half precision; float32 takes the "ieee" dot with the same tile).
MATMUL_PLAN = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}


def _plan(
    bm: int, bn: int, bk: int, warps: int, stages: int, tma: bool = False, persistent: bool = False
) -> dict:
    """A tile; `tma`: its operands moved by bulk-copy descriptors; `persistent` (with tma):
    one program per SM walking the tiles."""
    plan = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
    if tma:
        plan["tma"] = True
    if persistent:
        plan["persistent"] = True
    return plan


# Hopper (sm_90) tiles by row count: (largest M, plan). Every tile tried gave the one
# plan's bits in bfloat16 on Qwen3-8B's linears: 36 on an H200 (M = 1, 64, 256, 4096), 115
# on an H100 (M = 256, 4096: BLOCK_M 64/128/256 x BLOCK_N 64/128/256 x BLOCK_K 64/128 x
# 4/8 warps x 3/4/5 stages, each by pointers, bulk copies and persistent; benchmarks/
# batch_invariant_plans.py, docs/benchmarks/deterministic.md). That fits wgmma feeding K to
# the float32 accumulator in the same order whatever the tile's M, N, BLOCK_K or loads.
# The table is that H100 sweep's fastest by summed time per range, timed in CUDA graphs
# (the M <= 128 tile from the H200's): 129-512 rows a 64 x 128 x 128 tile by bulk copies on
# a persistent grid, above that the 128 x 256 tile by bulk copies (at 4,096 rows at most
# 4.2% over cuBLAS). The mode's cost on Qwen3-8B at 256 requests, same machine: 27.3% with
# the table before, 17.5-19.1% with the bulk-copy tile above 512 rows only, 13.6-15.2%
# with this table (four runs). Other GPUs keep the one plan (not measured there: mma.sync
# tiles may sum in another order).
SM90_MATMUL_PLANS = (
    (128, _plan(64, 64, 128, 8, 4)),
    (512, _plan(64, 128, 128, 4, 4, tma=True, persistent=True)),
    (None, _plan(128, 256, 64, 8, 3, tma=True)),
)


# Tiles for particular weight shapes (N, K), each a table like SM90_MATMUL_PLANS: a tuned
# table (benchmarks/batch_invariant_plans.py --tables, KVLOOM_DETERMINISTIC_TILES) may give
# a layer shape its own tiles; other shapes take SM90_MATMUL_PLANS. None built in.
SM90_SHAPE_PLANS: dict[tuple[int, int], tuple] = {}
_PLAN_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def _row_ranges(plans, what: str) -> tuple:
    """[[largest M or None, plan], ...] checked: ascending bounds, the last None, each plan
    a full tile."""
    try:
        bounds = [most for most, _ in plans]
    except (TypeError, ValueError):
        raise ValueError(f"{what}: expected [[largest M or null, plan], ...]") from None
    if (
        not plans
        or bounds[-1] is not None
        or None in bounds[:-1]
        or bounds[:-1] != sorted(bounds[:-1])
    ):
        raise ValueError(f"{what}: expected ascending row bounds ending in None, got {bounds}")
    for _, plan in plans:
        missing = [key for key in _PLAN_KEYS if not isinstance(plan.get(key), int)]
        if missing:
            raise ValueError(f"{what}: a plan lacks integer {missing}: {plan}")
    return tuple((most, dict(plan)) for most, plan in plans)


def _shape_key(key) -> tuple[int, int]:
    """(N, K) from a table key: "N,K" (JSON) or a tuple."""
    parts = key if isinstance(key, tuple) else str(key).split(",")
    try:
        n, k = (int(part) for part in parts)
    except (TypeError, ValueError):
        raise ValueError(
            f"by_shape: expected keys 'N,K' (a weight's rows and columns), got {key!r}"
        ) from None
    return n, k


def set_matmul_table(plans, by_shape=None) -> None:
    """Replaces this process's Hopper tile table with one written by
    benchmarks/batch_invariant_plans.py --tables: `plans` [[largest M or None, plan], ...],
    ascending, the last None; `by_shape` {"N,K": such a list} for weight shapes with tiles
    of their own. Set it before an engine starts: captured CUDA graphs keep their tiles.
    (Every tile must give the one plan's bits, or the mode is no longer batch-invariant:
    the sweep checks each and writes only those.)"""
    global SM90_MATMUL_PLANS, SM90_SHAPE_PLANS
    table = _row_ranges(plans, "plans")
    shapes = {
        _shape_key(key): _row_ranges(ranges, f"by_shape[{key!r}]")
        for key, ranges in (by_shape or {}).items()
    }
    SM90_MATMUL_PLANS, SM90_SHAPE_PLANS = table, shapes


def matmul_table() -> tuple[tuple, dict]:
    """(plans, by_shape) in force: what set_matmul_table takes to restore them."""
    return SM90_MATMUL_PLANS, dict(SM90_SHAPE_PLANS)


def load_matmul_table(path) -> None:
    """set_matmul_table from a table file ({"plans": [...], "by_shape": {...}}); errors
    name the file."""
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: cannot read a tile table: {err}") from None
    if not isinstance(table, dict) or "plans" not in table:
        raise ValueError(f'{path}: expected {{"plans": [...], "by_shape": {{...}}}}')
    try:
        set_matmul_table(table["plans"], table.get("by_shape"))
    except (AttributeError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: {err}") from None


def load_env_matmul_table() -> None:
    """The table KVLOOM_DETERMINISTIC_TILES names, if any (where a deterministic model is
    built, in the process that runs it)."""
    path = envs.get("KVLOOM_DETERMINISTIC_TILES")
    if path:
        try:
            load_matmul_table(path)
        except ValueError as err:
            raise ValueError(f"KVLOOM_DETERMINISTIC_TILES: {err}") from None


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def matmul_plan(
    m: int,
    capability: tuple[int, int] | None,
    dtype: torch.dtype,
    shape: tuple[int, int] | None = None,
) -> dict:
    """The tile for an M-row launch of `dtype` against a weight of `shape` (N, K) on a
    device of this compute capability (None: not a CUDA device, e.g. the interpreter).
    Float32 keeps the one plan: only half-precision tiles were measured."""
    half = dtype in (torch.bfloat16, torch.float16)
    if capability is None or capability[0] != 9 or not half:
        return MATMUL_PLAN
    ranges = SM90_SHAPE_PLANS.get(shape, SM90_MATMUL_PLANS)
    return next(plan for most, plan in ranges if most is None or m <= most)


_STATE_TILE_ELEMENTS = 4096  # the delta-rule program's [Dk, BV] float32 state tile
_CONV_BLOCK_C = 64
# Packed tokens a program of the token-parallel conv. On an H100 (thirtieth session; 126
# decodes beside two prompt chunks, a layer's conv, same bits as the loop): Kimi-Linear's
# channels 138.4 us against the loop's 112.9 at 128 tokens, 200.8 against 356.8 at 512,
# 342.9 against 655.1 at 1,024; offline no change (Kimi-Linear-16l 74.53 s against 74.32).
# (Those figures are the form that reloaded a row's scalars every token; the form below,
# which loads them once a row, is not yet timed.)
CONV_TOKENS_PER_PROGRAM = 16
# Warps of the serial recurrence's program outside the deterministic mode. A long row's
# time is its chain of token steps, and two warps take each token's sums over the key
# channels through fewer cross-warp steps than four. On an H100 (126 decodes beside two
# prompt chunks, float32 state), Kimi-Linear's heads: 905.5 us against 1031.0 at 512
# tokens, 1552.7 against 1877.1 at 1,024 (twenty-ninth session; Kimi-Linear-16l offline
# 75.70 s against 77.93); Qwen3-Next's: 844.3 against 1000.8 at 512, 1452.1 against 1826.7
# at 1,024, a tie at 128 (thirtieth). Another summation order than the decode kernel's four
# warps, so the deterministic mode keeps four.
SERIAL_WARPS = 2


def serial_recurrence_tiling(head_k: int, head_v: int, deterministic: bool) -> tuple[int, int]:
    """(state columns, warps) of a `_serial_delta_rule_kernel` program, Gated DeltaNet's and
    KDA's alike: the decode kernel's [Dk, BV] tile of _STATE_TILE_ELEMENTS, on four warps in
    the deterministic mode (the decode kernel's order) and SERIAL_WARPS outside it."""
    tile_columns = _STATE_TILE_ELEMENTS // next_power_of_2(head_k)
    block_v = max(1, min(next_power_of_2(head_v), tile_columns))
    return block_v, 4 if deterministic else SERIAL_WARPS


@triton.jit
def _acc_dot(acc, a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b, both matmul kernels' one K step."""
    if UPCAST:  # the CPU interpreter gets bfloat16 dots wrong; products are exact
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return acc + tl.dot(a, b, input_precision=PRECISION)


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    depth = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + depth) < K
        a = tl.load(
            x_ptr + rows[:, None] * stride_xm + (k0 + depth)[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            w_ptr + cols[None, :] * stride_wn + (k0 + depth)[:, None],
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        acc = _acc_dot(acc, a, b, PRECISION, UPCAST)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows[:, None] * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit(do_not_specialize=["M"])
def _matmul_tma_kernel(
    x_desc,
    w_desc,
    out_desc,
    b_ptr,
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    """`_matmul_kernel` with its tiles moved by the tensor-memory accelerator (Hopper's
    bulk copies, host-built descriptors that zero-fill past the edges): the same tile, the
    same dots over K in the same order, so the same bits; fewer instructions per tile.
    PERSISTENT: a grid of at most one program per SM, each walking tiles in launch order
    (row tiles fastest, as the one-tile-per-program grid), so no tail wave."""
    row_tiles = tl.cdiv(M, BLOCK_M)
    num_tiles = row_tiles * tl.cdiv(N, BLOCK_N)
    first, step = tl.program_id(0), tl.num_programs(0)
    if not PERSISTENT:
        first = tl.program_id(1) * row_tiles + tl.program_id(0)
        step = num_tiles
    for tile in range(first, num_tiles, step):
        off_m = (tile % row_tiles) * BLOCK_M
        off_n = (tile // row_tiles) * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = x_desc.load([off_m, k0])
            b = w_desc.load([off_n, k0]).T
            acc = _acc_dot(acc, a, b, PRECISION, UPCAST)
        if HAS_BIAS:
            cols = off_n + tl.arange(0, BLOCK_N)
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        out_desc.store([off_m, off_n], acc.to(out_desc.dtype))


def _tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether bulk-copy descriptors can describe these 2-D tensors: 16-byte aligned base
    and row stride, unit column stride."""
    return all(
        t.data_ptr() % 16 == 0 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
        for t in tensors
    )


def _matmul_tma(x, weight, bias, out, plan, upcast) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk = plan["BLOCK_M"], plan["BLOCK_N"], plan["BLOCK_K"]
    (m, k), n = x.shape, weight.shape[0]
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    persistent = bool(plan.get("persistent"))
    if persistent:
        grid = (min(grid[0] * grid[1], _sm_count(x.device)),)
    _matmul_tma_kernel[grid](
        TensorDescriptor.from_tensor(x, [bm, bk]),
        TensorDescriptor.from_tensor(weight, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]),
        bias if bias is not None else x,
        m,
        n,
        k,
        HAS_BIAS=bias is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=upcast,
        PERSISTENT=persistent,
        num_warps=plan["num_warps"],
        num_stages=plan["num_stages"],
    )


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the interpreter: a few, so persistent
    programs walk several tiles)."""
    if device.type != "cuda":
        return 3
    return _cuda_sm_count(device.index)


@functools.cache
def _cuda_sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def matmul_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    plan: dict | None = None,
):
    """x [M, K] (last dim contiguous) @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype.
    plan: a tile other than MATMUL_PLAN (benchmarks/batch_invariant_plans.py compares them);
    one with "tma" moves its tiles by bulk copies where the tensors allow (`_tma_ready`),
    and with "persistent" too runs one program per SM."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x, weight: expected [M, K] and [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.stride(1) != 1 and x.shape[1] > 1:
        x = x.contiguous()
    if weight.stride(1) != 1 and weight.shape[1] > 1:
        weight = weight.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if plan is None:
        cuda = x.is_cuda and not is_interpreted(_matmul_kernel)
        plan = matmul_plan(m, _capability(x.device.index) if cuda else None, x.dtype, (n, k))
    upcast = is_interpreted(_matmul_kernel) and x.dtype != torch.float32
    # Bulk copies for half precision only: float32's FMA dot (no wgmma) spills with them.
    if plan.get("tma") and x.dtype != torch.float32 and _tma_ready(x, weight, out):
        _matmul_tma(x, weight, bias, out, plan, upcast)
        return out
    grid = (triton.cdiv(m, plan["BLOCK_M"]), triton.cdiv(n, plan["BLOCK_N"]))
    _matmul_kernel[grid](
        x,
        weight,
        bias if bias is not None else x,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=plan["BLOCK_M"],
        BLOCK_N=plan["BLOCK_N"],
        BLOCK_K=plan["BLOCK_K"],
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=upcast,
        num_warps=plan["num_warps"],
        num_stages=plan["num_stages"],
    )
    return out


@triton.jit
def _conv_taps(x_ptr, state_row, start, pos, chans, chan_ok, taps, has_state, stride_xt,
               WIDTH: tl.constexpr, NUM_TAPS: tl.constexpr):  # fmt: skip
    """The inputs of the sequence's token `pos` (from its start) over the first NUM_TAPS
    taps: tap j reads input pos - (WIDTH - 1) + j, this sequence's token, or the carried
    state before it (column WIDTH - 1 + offset), or zero for a fresh sequence. -> (tokens'
    values, state values, which taps read tokens), float32 [BLOCK_C, WIDTH_PAD]. With
    pos = the row's length and WIDTH - 1 taps: the row's new state."""
    offset = pos - (WIDTH - 1) + taps
    in_x = (offset >= 0) & (taps < NUM_TAPS)
    in_s = (offset < 0) & (taps < NUM_TAPS) & has_state
    xs = tl.load(
        x_ptr + (start + offset)[None, :] * stride_xt + chans[:, None],
        mask=chan_ok[:, None] & in_x[None, :],
        other=0.0,
    ).to(tl.float32)
    ss = tl.load(
        state_row + (WIDTH - 1 + offset)[None, :],
        mask=chan_ok[:, None] & in_s[None, :],
        other=0.0,
    ).to(tl.float32)
    return xs, ss, in_x


@triton.jit
def _conv_weights(weight_ptr, bias_ptr, chans, chan_ok, taps, stride_wc, WIDTH: tl.constexpr):
    """The channels' taps [BLOCK_C, WIDTH_PAD] and bias [BLOCK_C], float32 (bias_ptr is the
    weight's without a bias: loaded, never used)."""
    weight = tl.load(
        weight_ptr + chans[:, None] * stride_wc + taps[None, :],
        mask=chan_ok[:, None] & (taps < WIDTH)[None, :],
        other=0.0,
    ).to(tl.float32)
    bias = tl.load(bias_ptr + chans, mask=chan_ok, other=0.0).to(tl.float32)
    return weight, bias


@triton.jit
def _conv_out(xs, ss, in_x, weight, bias, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """One token's output from its taps (`_conv_taps`): the one per-token arithmetic of the
    serial loop and the token-parallel form."""
    y = tl.sum(tl.where(in_x[None, :], xs, ss) * weight, axis=1)
    if HAS_BIAS:
        y = y + bias
    if SILU:
        y = y * tl.sigmoid(y)
    return y


@triton.jit
def _serial_conv_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    state_ptr,
    cu_ptr,
    slot_ptr,
    has_state_ptr,
    out_ptr,
    stride_xt,
    stride_wc,
    stride_ss,
    stride_sc,
    stride_ot,
    CHANNELS: tl.constexpr,
    WIDTH: tl.constexpr,
    WIDTH_PAD: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    seq = tl.program_id(0)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    chan_ok = chans < CHANNELS
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    taps = tl.arange(0, WIDTH_PAD)
    # Padding (slot < 0) and rows with no tokens this step: nothing read or written (the
    # output is pre-zeroed).
    if (slot >= 0) & (end > start):
        # As a vector over the taps (the interpreter takes no scalar in a mask).
        has_state = (taps * 0 + tl.load(has_state_ptr + seq).to(tl.int32)) != 0
        state_row = state_ptr + slot * stride_ss + chans[:, None] * stride_sc
        weight, bias = _conv_weights(weight_ptr, bias_ptr, chans, chan_ok, taps, stride_wc, WIDTH)
        # Each token's taps are loaded one token ahead (the last token's again at the end),
        # so their latency overlaps the previous token's sum: same values, same bits.
        next_xs, next_ss, next_in_x = _conv_taps(
            x_ptr, state_row, start, 0, chans, chan_ok, taps, has_state, stride_xt, WIDTH, WIDTH
        )
        for t in range(start, end):
            xs, ss, in_x = next_xs, next_ss, next_in_x
            next_xs, next_ss, next_in_x = _conv_taps(
                x_ptr, state_row, start, tl.minimum(t + 1, end - 1) - start, chans, chan_ok,
                taps, has_state, stride_xt, WIDTH, WIDTH,
            )  # fmt: skip
            y = _conv_out(xs, ss, in_x, weight, bias, HAS_BIAS, SILU)
            tl.store(out_ptr + t * stride_ot + chans, y.to(out_ptr.dtype.element_ty), mask=chan_ok)
        _store_conv_state(
            x_ptr, state_row, start, end, chans, chan_ok, taps, has_state, stride_xt, WIDTH
        )


@triton.jit
def _store_conv_state(x_ptr, state_row, start, end, chans, chan_ok, taps, has_state, stride_xt,
                      WIDTH: tl.constexpr):  # fmt: skip
    """A row's new conv state: its last WIDTH - 1 inputs, read (old state included) before
    the store overwrites it."""
    xs, ss, in_x = _conv_taps(
        x_ptr, state_row, start, end - start, chans, chan_ok, taps, has_state, stride_xt,
        WIDTH, WIDTH - 1,
    )  # fmt: skip
    keep = taps < WIDTH - 1
    new_state = tl.where(in_x[None, :], xs, ss)
    tl.debug_barrier()
    tl.store(
        state_row + taps[None, :],
        new_state.to(state_row.dtype.element_ty),
        mask=chan_ok[:, None] & keep[None, :],
    )


@triton.jit
def row_of(cu_ptr, token, num_seqs, search_steps):
    """The row owning packed token `token` (< cu[num_seqs]; a scalar or a vector of them):
    the last n with cu[n] <= token, so empty rows before it are passed over, i.e.
    torch.searchsorted(cu[1:], token, right=True). Binary search keeping cu[lo] <= token <
    cu[hi]; a token past cu[num_seqs] (padding) lands on row num_seqs - 1. The index type
    is the token's. Also the varlen conv's (causal_conv1d_triton)."""
    lo = token * 0
    hi = lo + num_seqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        right = tl.load(cu_ptr + mid) <= token
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo


# num_seqs changes every step: not specialized (no compile mid-run for a new count).
@triton.jit(do_not_specialize=["num_seqs"])
def _token_conv_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    state_ptr,
    cu_ptr,
    slot_ptr,
    has_state_ptr,
    out_ptr,
    num_seqs,
    search_steps,
    stride_xt,
    stride_wc,
    stride_ss,
    stride_sc,
    stride_ot,
    CHANNELS: tl.constexpr,
    WIDTH: tl.constexpr,
    WIDTH_PAD: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    """`_serial_conv_kernel`'s per-token arithmetic over BLOCK_T consecutive packed tokens
    (whichever rows they belong to) a program: an output reads inputs only, never earlier
    outputs, so a long row needs no chain of token steps. Reads the old states and leaves
    them: `_conv_state_kernel`, launched after, stores the new ones."""
    first = tl.program_id(0).to(tl.int64) * BLOCK_T
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    chan_ok = chans < CHANNELS
    taps = tl.arange(0, WIDTH_PAD)
    total = tl.load(cu_ptr + num_seqs).to(tl.int64)
    if first < total:  # tokens past the last row (graph padding) keep their zeros
        weight, bias = _conv_weights(weight_ptr, bias_ptr, chans, chan_ok, taps, stride_wc, WIDTH)
        # A row's bounds, slot and flag are loaded once, when the block reaches the row, so
        # a token's loads are its taps alone (no scalar loads ahead of them each token).
        row = row_of(cu_ptr, first, num_seqs, search_steps)
        start = tl.load(cu_ptr + row).to(tl.int64)
        row_end = tl.load(cu_ptr + row + 1).to(tl.int64)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        flag = tl.load(has_state_ptr + row).to(tl.int32)
        for t in range(first, tl.minimum(first + BLOCK_T, total)):
            while row_end <= t:  # the next non-empty row
                row += 1
                start = row_end
                row_end = tl.load(cu_ptr + row + 1).to(tl.int64)
                slot = tl.load(slot_ptr + row).to(tl.int64)
                flag = tl.load(has_state_ptr + row).to(tl.int32)
            if slot >= 0:  # padding rows: nothing read or written
                has_state = (taps * 0 + flag) != 0
                state_row = state_ptr + slot * stride_ss + chans[:, None] * stride_sc
                xs, ss, in_x = _conv_taps(
                    x_ptr, state_row, start, t - start, chans, chan_ok, taps, has_state,
                    stride_xt, WIDTH, WIDTH,
                )  # fmt: skip
                y = _conv_out(xs, ss, in_x, weight, bias, HAS_BIAS, SILU)
                out = out_ptr + t * stride_ot + chans
                tl.store(out, y.to(out_ptr.dtype.element_ty), mask=chan_ok)


@triton.jit
def _conv_state_kernel(
    x_ptr,
    state_ptr,
    cu_ptr,
    slot_ptr,
    has_state_ptr,
    stride_xt,
    stride_ss,
    stride_sc,
    CHANNELS: tl.constexpr,
    WIDTH: tl.constexpr,
    WIDTH_PAD: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Each row's new conv state after `_token_conv_kernel` (the same store as the serial
    kernel's last one)."""
    seq = tl.program_id(0)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    chan_ok = chans < CHANNELS
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    if (slot >= 0) & (end > start):
        taps = tl.arange(0, WIDTH_PAD)
        has_state = (taps * 0 + tl.load(has_state_ptr + seq).to(tl.int32)) != 0
        state_row = state_ptr + slot * stride_ss + chans[:, None] * stride_sc
        _store_conv_state(
            x_ptr, state_row, start, end, chans, chan_ok, taps, has_state, stride_xt, WIDTH
        )


def serial_causal_conv1d_triton(
    x, weight, bias, conv_state_pool, cu_seqlens, state_indices, has_initial_state, activation,
    token_parallel: bool = False, block_t: int = CONV_TOKENS_PER_PROGRAM,
):  # fmt: skip
    """See `batch_invariant.serial_causal_conv1d`. `token_parallel`: `block_t` packed tokens
    a program (`_token_conv_kernel`, then the states) instead of one program looping over a
    row's tokens: the same per-token arithmetic, without the long row's chain of steps."""
    tokens, channels = x.shape
    width = weight.shape[1]
    # Zeros: tokens past the last row (graph padding) stay defined.
    out = torch.zeros_like(x, memory_format=torch.contiguous_format)
    num_seqs = cu_seqlens.shape[0] - 1
    if tokens == 0 or num_seqs == 0 or channels == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if token_parallel:
        _token_parallel_conv(
            x, weight, bias, conv_state_pool, cu_seqlens, state_indices, has_initial_state,
            activation, out, block_t,
        )  # fmt: skip
        return out
    grid = (num_seqs, triton.cdiv(channels, _CONV_BLOCK_C))
    _serial_conv_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        conv_state_pool,
        cu_seqlens,
        state_indices,
        has_initial_state.to(torch.int8),
        out,
        x.stride(0),
        weight.stride(0),
        conv_state_pool.stride(0),
        conv_state_pool.stride(1),
        out.stride(0),
        CHANNELS=channels,
        WIDTH=width,
        WIDTH_PAD=max(2, next_power_of_2(width)),
        BLOCK_C=_CONV_BLOCK_C,
        HAS_BIAS=bias is not None,
        SILU=activation in ("silu", "swish"),
        num_warps=4,
    )
    return out


def _token_parallel_conv(
    x, weight, bias, pool, cu_seqlens, state_indices, has_initial_state, activation, out, block_t
) -> None:
    """The token-parallel conv's two launches (see `serial_causal_conv1d_triton`)."""
    tokens, channels = x.shape
    width = weight.shape[1]
    num_seqs = cu_seqlens.shape[0] - 1
    has_state = has_initial_state.to(torch.int8)
    chan_blocks = triton.cdiv(channels, _CONV_BLOCK_C)
    consts = dict(
        CHANNELS=channels, WIDTH=width, WIDTH_PAD=max(2, next_power_of_2(width)),
        BLOCK_C=_CONV_BLOCK_C,
    )  # fmt: skip
    _token_conv_kernel[(triton.cdiv(tokens, block_t), chan_blocks)](
        x,
        weight,
        bias if bias is not None else weight,
        pool,
        cu_seqlens,
        state_indices,
        has_state,
        out,
        num_seqs,
        num_seqs.bit_length() + 1,
        x.stride(0),
        weight.stride(0),
        pool.stride(0),
        pool.stride(1),
        out.stride(0),
        BLOCK_T=block_t,
        HAS_BIAS=bias is not None,
        SILU=activation in ("silu", "swish"),
        num_warps=4,
        **consts,
    )
    _conv_state_kernel[(num_seqs, chan_blocks)](
        x,
        pool,
        cu_seqlens,
        state_indices,
        has_state,
        x.stride(0),
        pool.stride(0),
        pool.stride(1),
        num_warps=4,
        **consts,
    )


@triton.jit
def _serial_delta_rule_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    cu_ptr,
    slot_ptr,
    has_state_ptr,
    out_ptr,
    scale,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
    PER_CHANNEL_DECAY: tl.constexpr = False,
    ROUND_EVERY_TOKEN: tl.constexpr = True,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    col_ok = cols < DV
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    if (slot >= 0) & (end > start):  # else padding or no tokens: nothing touched
        dims = tl.arange(0, BK)
        dim_ok = dims < DK
        key_head = head // GROUP
        tile_ok = dim_ok[:, None] & col_ok[None, :]
        s_ptrs = state_ptr + slot * stride_ss + head * stride_sh
        s_ptrs = s_ptrs + dims[:, None] * stride_sk + cols[None, :]
        has_state = (cols * 0 + tl.load(has_state_ptr + seq).to(tl.int32)) != 0
        s = tl.load(s_ptrs, mask=tile_ok & has_state[None, :], other=0.0).to(tl.float32)
        q_row = q_ptr + key_head * stride_qh + dims
        k_row = k_ptr + key_head * stride_kh + dims
        v_row = v_ptr + head * stride_vh + cols
        g_row = g_ptr + head * stride_gh
        beta_row = beta_ptr + head
        # A long row is a chain of dependent token steps: each step's inputs are loaded
        # one step ahead (the last token's again at the end: no scalar mask), so their
        # memory latency overlaps the previous step's arithmetic. Same values, same bits.
        next_q = tl.load(q_row + start * stride_qt, mask=dim_ok, other=0.0)
        next_k = tl.load(k_row + start * stride_kt, mask=dim_ok, other=0.0)
        next_v = tl.load(v_row + start * stride_vt, mask=col_ok, other=0.0)
        if PER_CHANNEL_DECAY:  # KDA: one log-decay per key channel
            next_g = tl.load(g_row + start * stride_gt + dims, mask=dim_ok, other=0.0)
        else:
            next_g = tl.load(g_row + start * stride_gt)
        next_beta = tl.load(beta_row + start * stride_bt)
        for t in range(start, end):
            q, k, v, g, beta = next_q, next_k, next_v, next_g, next_beta
            ahead = tl.minimum(t + 1, end - 1)
            next_q = tl.load(q_row + ahead * stride_qt, mask=dim_ok, other=0.0)
            next_k = tl.load(k_row + ahead * stride_kt, mask=dim_ok, other=0.0)
            next_v = tl.load(v_row + ahead * stride_vt, mask=col_ok, other=0.0)
            if PER_CHANNEL_DECAY:
                next_g = tl.load(g_row + ahead * stride_gt + dims, mask=dim_ok, other=0.0)
            else:
                next_g = tl.load(g_row + ahead * stride_gt)
            next_beta = tl.load(beta_row + ahead * stride_bt)
            q = q.to(tl.float32)
            k = k.to(tl.float32)
            if L2NORM:
                q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps)
                k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
            q = q * scale
            if PER_CHANNEL_DECAY:
                s = s * tl.exp(g.to(tl.float32))[:, None]
            else:
                s = s * tl.exp(g.to(tl.float32))
            beta = beta.to(tl.float32)
            predicted = tl.sum(k[:, None] * s, axis=0)
            write = beta * (v.to(tl.float32) - predicted)
            s = s + k[:, None] * write[None, :]
            out = tl.sum(q[:, None] * s, axis=0)
            out_ptrs = out_ptr + t * stride_ot + head * stride_oh + cols
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=col_ok)
            if ROUND_EVERY_TOKEN:  # as if stored after every token: chunking changes no bits
                s = s.to(state_ptr.dtype.element_ty).to(tl.float32)
        tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=tile_ok)


def serial_gated_delta_rule_triton(
    q, k, v, g, beta, state, cu_seqlens, state_indices, has_initial_state, scale, use_qk_l2norm,
    per_channel_decay: bool = False, round_every_token: bool = True,
    block_v: int | None = None, num_warps: int | None = None,
):  # fmt: skip
    """See `batch_invariant.serial_gated_delta_rule`; `per_channel_decay`: g [T, Hv, Dk],
    KDA's gate (`batch_invariant.serial_kda`). `round_every_token`: the deterministic
    mode's form (a narrow state rounded after every token, and the decode kernel's tiling:
    `serial_recurrence_tiling`). `block_v` / `num_warps` override the tiling
    (benchmarks/serial_mixed_step.py --tilings; another tiling may sum in another order)."""
    tokens, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1], v.shape[2]
    out = torch.zeros((tokens, num_v_heads, head_v), dtype=q.dtype, device=q.device)
    num_seqs = cu_seqlens.shape[0] - 1
    if out.numel() == 0 or num_seqs == 0:
        return out
    # The callers pass the deterministic mode as round_every_token (batch_invariant()).
    plan = serial_recurrence_tiling(head_k, head_v, bool(round_every_token))
    block_v, num_warps = block_v or plan[0], num_warps or plan[1]
    g = g.contiguous()
    beta = beta.contiguous()
    grid = (num_seqs, num_v_heads, triton.cdiv(head_v, block_v))
    _serial_delta_rule_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        state,
        cu_seqlens,
        state_indices,
        has_initial_state.to(torch.int8),
        out,
        float(head_k**-0.5 if scale is None else scale),
        L2NORM_EPS,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        state.stride(0),
        state.stride(1),
        state.stride(2),
        out.stride(0),
        out.stride(1),
        GROUP=num_v_heads // num_k_heads,
        DK=head_k,
        DV=head_v,
        BK=next_power_of_2(head_k),
        BV=block_v,
        L2NORM=bool(use_qk_l2norm),
        PER_CHANNEL_DECAY=per_channel_decay,
        ROUND_EVERY_TOKEN=bool(round_every_token) and state.dtype != torch.float32,
        num_warps=num_warps,
    )
    return out
