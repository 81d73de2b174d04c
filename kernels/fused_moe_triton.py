"""Routed mixture-of-experts: the Triton kernels.

Same semantics and rounding points as `fused_moe.fused_moe_ref` (read its docstring):
float32 accumulation, the activation silu(gate) * up rounded once to the hidden dtype, the
routing weight applied in float32, the k contributions of a token summed in slot order.

Five launches (three in the pairs plan below), no host synchronisation (every buffer and
grid size follows from T, k, E and the route block size alone), so one call can be
captured in a CUDA graph:

1. `_count_routes_kernel`, one program per expert: how many of the N = T * k routes
   (route r = token r // k, slot r % k) chose it.
2. `_place_routes_kernel`, one program per expert: from the counts, each expert's first
   route block (counts rounded up to whole blocks of BLOCK_M, summed over lower experts);
   the expert writes its routes there in route order (stable), pads its last block with
   the sentinel N, and writes its id into `block_expert` for each of its blocks. One extra
   program marks the blocks past the last used one with -1. The sorted buffer has room
   for N + min(E, N) * (BLOCK_M - 1) routes, the most any routing can need.
3. `_gate_up_kernel`, one program per (route block, tile of BLOCK_N intermediate
   columns): the gate and up projections of the block's tokens against its expert's
   weights, fused with silu(gate) * up in the epilogue; writes the activation per route.
4. `_down_kernel`, one program per (route block, tile of BLOCK_N hidden columns): the
   down projection times the routing weight, written per route to a [T, k, H] float32
   buffer. Blocks marked -1 exit at once (the grid is the host-known upper bound).
5. `_sum_slots_kernel`: out[t] = sum over j = 0..k-1 of that buffer, in order, rounded
   to the hidden dtype. No atomics anywhere, so results are deterministic.

Both GEMMs put the weight rows in the dot's M slot and the route block's tokens in its N
slot (weights^T-style "swap AB"): at decode an expert sees a handful of tokens, and the
weight tile fills the matrix units' 64-row minimum instead of padding tokens up to it.
It also keeps every plan on one kind of instruction: on Hopper the dot's M (BLOCK_N = 64)
qualifies for wgmma whatever BLOCK_M is, where tokens in M would switch between mma.sync
(BLOCK_M < 64) and wgmma (BLOCK_M = 64), whose float32 accumulation need not agree.

The align programs each scan all N routes (chunks of ROUTE_CHUNK): a few microseconds
at decode sizes; at long prefills (N ~ 1e5) this grows, but stays small beside the GEMMs.

The pairs plan (decode, `uses_pairs_plan`: CUDA, half precision, T <= PAIRS_PLAN_MAX_TOKENS,
not deterministic mode) skips launches 1 and 2: route r is route block r on its own (one
valid row, the sentinel N in the others), its expert topk_ids[r // k, r % k] read by the
GEMM programs themselves, so gate_up and down launch over the N routes directly and the
slot sum follows: three launches. Its BLOCK_M is the sorted plan's at those sizes (16)
and each block computes the same dots over the same K tiles, so it is bitwise the sorted
plan too.

With `moe_slot_sum` (default on a GPU, `uses_slot_sum`) the pairs plan drops the slot-sum launch
too: each of a token's k down programs of a column tile arrives at a counter after its
store, and the last sums the k slots with the slot-sum kernel's code (`_store_slot_sum`):
two launches, the same bits.

Invariant 7 (plans by size, same answer): the route block size BLOCK_M is chosen from the
launch shape (`choose_block_m`, tokens per expert on average) and is the only thing the
plans change. A route's results are written by route index, never by sorted position,
and each output element is a dot over the same BLOCK_K tiles in the same K order whatever
BLOCK_M is (BLOCK_N, BLOCK_K, warps and stages are fixed), so every plan gives bitwise
the same output (tested on the interpreter; the gpu test checks it compiled).

Expert ids are not validated on the device (that would need a host sync): a route whose
id is outside [0, E) matches no expert, is never placed or computed, and contributes
nothing to its token; no memory is read out of bounds for it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.contracts import envs
from kvloom.kernels.arg_checks_triton import (
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
    is_interpreted,
    next_power_of_2,
)
from kvloom.kernels.arrival_counters import arrival_counters
from kvloom.kernels.device_sms import sm_count
from kvloom.kernels.dispatch import batch_invariant
from kvloom.kernels.fused_moe import check_moe_args

BLOCK_M_CHOICES = (16, 32, 64)
# Fixed for every plan (invariant 7): they decide each output element's summation order.
BLOCK_N = 64
BLOCK_K = 64
NUM_WARPS = 4
NUM_STAGES = 3
ROUTE_CHUNK = 1024  # routes one align program scans per step
BLOCK_CHUNK = 256  # block ids one align program writes per step
MAX_SUM_BLOCK = 1024
# The pairs (decode) plan: each of the T * k routes is a route block of its own (one valid
# row of PAIRS_BLOCK_M), its expert read from topk_ids, so the count and place launches
# go (5 launches -> 3). It reads an expert's weights once per route where the sorted plan
# reads them once per expert, so tokens that share an expert read it again. A token's k
# experts are distinct: T = 1 reads nothing twice. Qwen3-Next (512 experts, top 10, the
# shared expert folded in, 6.3 MB an expert in bf16): T tokens read the shared expert
# T - 1 extra times and routed ones about C(T, 2) * 10 * 10 / 512 extra times: T = 2
# ~1.2 extra reads (~1.6 us of HBM at 4.8 TB/s), T = 4 ~4.2 (~10% more bytes, ~5.5 us),
# less where the second read hits L2 (both run in the same wave), against the ~4-8 us the
# two launches cost in a CUDA graph. A clear win to T = 2, about even at 4, so the plan
# stops at 4 tokens (batch-1 decode with up to 3 speculative tokens).
# benchmarks/moe_layer_launches.py times both plans at T = 1, 2, 4, 8 to check it.
PAIRS_PLAN_MAX_TOKENS = 4
PAIRS_BLOCK_M = BLOCK_M_CHOICES[0]  # the sorted plan's block at decode sizes
# The pairs plan's software-pipelining depths (gate_up, down). At one token its gate_up
# launch is only T * k * (I / BLOCK_N) programs (Qwen3-Next: 80, 88 with the shared expert
# folded in: fewer than the SMs), each streaming K = H columns. The depth schedules the
# same dots over the same K tiles: the same bits at any depth. On an H100 (twenty-sixth
# session, docs/benchmarks/data/moe_pairs_stages_h100_2026-12-07s26.json) depth 4 at one
# token took a layer from 47.21 to 45.34 us (Qwen3-Next, shared expert folded), 54.23 to
# 51.96 (two branches), 67.48 to 66.64 and 75.10 to 73.46 (Kimi-Linear); 6 gained more on
# Qwen3-Next (44.37) but lost on Kimi-Linear (69.40). At two and four tokens depth 3 was
# the fastest or within 2%, so deeper pipelines stay at one token. What sets 6 apart is
# the gate_up grid: Qwen3-Next's 88 programs leave SMs idle (each program streams more
# when it keeps more loads in flight), Kimi-Linear's 144 (9 routes x 16 tiles) and every
# two-token grid do not (Kimi-Linear with its shared expert apart, 8 x 16 = 128 programs,
# takes 6: 73.58 us a layer against 73.46 at 4, level). End to end on an H100, depth 6
# took Qwen3-Next-16l batch-1 from 1.618 to 1.608 ms/token (twenty-sixth) and 1.587 to
# 1.576 (twenty-seventh).
# KVLOOM_MOE_DECODE_STAGES overrides both (benchmarks/moe_layer_launches.py --pairs-stages).
PAIRS_STAGES_FEW_PROGRAMS = (6, 6)
PAIRS_STAGES_ONE_TOKEN = (4, 4)
PAIRS_STAGES = (NUM_STAGES, NUM_STAGES)


def pairs_stages(num_tokens: int, idle_sms: bool) -> tuple[int, int]:
    """(gate_up, down) num_stages of a pairs-plan launch over `num_tokens` tokens;
    `idle_sms`: its gate_up grid has no more programs than the device has SMs."""
    chosen = envs.moe_decode_stages()
    if chosen:
        return chosen
    if num_tokens > 1:
        return PAIRS_STAGES
    return PAIRS_STAGES_FEW_PROGRAMS if idle_sms else PAIRS_STAGES_ONE_TOKEN


def choose_block_m(num_tokens: int, top_k: int, num_experts: int) -> int:
    """The route block size for a launch shape: small blocks while experts see few tokens
    each (decode: little padding), bigger ones when they see many (prefill: weight tiles
    reused across more tokens). Depends on the shape only, so a captured CUDA graph keeps
    its plan; all choices give the same answer."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    if per_expert <= 8:
        return 16
    if per_expert <= 24:
        return 32
    return 64


def uses_pairs_plan(hidden: torch.Tensor, sorted_block_m: int) -> bool:
    """Whether a launch takes the pairs (decode) plan: CUDA, half precision, at most
    PAIRS_PLAN_MAX_TOKENS tokens where the sorted plan would run the narrow block
    (`sorted_block_m`, the block its own chooser picks), so the pairs plan runs the very
    tiles the sorted plan would; not in deterministic mode (which keeps the sorted plans
    it had). Shapes and process settings only: a CUDA graph captured for a batch size
    keeps its plan."""
    return (
        hidden.is_cuda
        and hidden.dtype in (torch.float16, torch.bfloat16)
        and not batch_invariant()
        and 1 <= hidden.shape[0] <= PAIRS_PLAN_MAX_TOKENS
        and sorted_block_m == PAIRS_BLOCK_M
        and not envs.unfused("moe_pairs")
    )


def uses_slot_sum(hidden: torch.Tensor, pairs: bool) -> bool:
    """Whether a pairs-plan launch sums each token's k slots in its down launch (the last
    of a token's route programs to store does), with no slot-sum launch: on a GPU unless
    KVLOOM_UNFUSED names `moe_slot_sum`. Never chosen interpreted: the counter's
    cross-program order is what the gpu tests check (CPU tests pass slot_sum=True)."""
    return pairs and hidden.is_cuda and not envs.unfused("moe_slot_sum")


def slot_counters(device: torch.device, tokens: int, tiles: int) -> torch.Tensor:
    """The in-launch slot sum's arrival counters [tokens, tiles]: PAIRS_PLAN_MAX_TOKENS
    rows, the most the automatic plan launches (a bigger buffer only for forced launches)."""
    return arrival_counters("moe_slot_sum", device, tokens, tiles, PAIRS_PLAN_MAX_TOKENS)


def plan_route_blocks(
    hidden: torch.Tensor, block_m: int | None, pairs: bool | None, sorted_block_m: int
) -> tuple[int, bool]:
    """(block_m, pairs) of a launch from its overrides (None: choose). Shared by the
    float, W4A16 and FP8 MoE; `sorted_block_m` is the block the caller's sorted plan
    would pick."""
    if pairs is None:
        pairs = block_m is None and uses_pairs_plan(hidden, sorted_block_m)
    if block_m is None:
        block_m = PAIRS_BLOCK_M if pairs else sorted_block_m
    _check_block_m(block_m)
    if pairs and block_m != PAIRS_BLOCK_M:
        raise ValueError(f"block_m: the pairs plan runs with {PAIRS_BLOCK_M}, got {block_m}")
    return block_m, bool(pairs)


def route_blocks(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, pairs: bool, _fill=None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sorted_routes, block_expert, number of route blocks) for the GEMM launches. The
    pairs plan has one block per route and no sort buffers (its kernels never read them;
    topk_ids stands in for the pointers)."""
    if pairs:
        return topk_ids, topk_ids, topk_ids.numel()
    sorted_routes, block_expert = align_routes(topk_ids, num_experts, block_m, _fill=_fill)
    return sorted_routes, block_expert, block_expert.shape[0]


def max_route_blocks(num_routes: int, num_experts: int, block_m: int) -> int:
    """Most route blocks any routing of `num_routes` routes can fill: each of at most
    min(E, N) used experts wastes under one block on padding."""
    return (num_routes + min(num_experts, num_routes) * (block_m - 1)) // block_m


@triton.jit(do_not_specialize=["num_routes"])
def _count_routes_kernel(
    ids_ptr,
    counts_ptr,
    num_routes,
    top_k,
    stride_it,
    stride_ij,
    ROUTE_CHUNK: tl.constexpr,
):
    expert = tl.program_id(0)
    count = expert * 0
    for start in range(0, num_routes, ROUTE_CHUNK):
        routes = start + tl.arange(0, ROUTE_CHUNK)
        offs = (routes // top_k).to(tl.int64) * stride_it + (routes % top_k) * stride_ij
        ids = tl.load(ids_ptr + offs, mask=routes < num_routes, other=-1)
        count += tl.sum((ids == expert).to(tl.int32), axis=0)
    tl.store(counts_ptr + expert, count)


@triton.jit(do_not_specialize=["num_routes", "max_blocks"])
def _place_routes_kernel(
    ids_ptr,
    counts_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_routes,
    top_k,
    num_experts,
    max_blocks,
    stride_it,
    stride_ij,
    BLOCK_M: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    ROUTE_CHUNK: tl.constexpr,
    BLOCK_CHUNK: tl.constexpr,
):
    expert = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_PAD)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    first_block = tl.sum(tl.where(experts < expert, blocks, 0), axis=0)
    if expert < num_experts:
        count = tl.sum(tl.where(experts == expert, counts, 0), axis=0)
        num_blocks = (count + BLOCK_M - 1) // BLOCK_M
        base = first_block * BLOCK_M
        placed = expert * 0
        for start in range(0, num_routes, ROUTE_CHUNK):
            routes = start + tl.arange(0, ROUTE_CHUNK)
            offs = (routes // top_k).to(tl.int64) * stride_it + (routes % top_k) * stride_ij
            ids = tl.load(ids_ptr + offs, mask=routes < num_routes, other=-1)
            hit = ids == expert
            rank = tl.cumsum(hit.to(tl.int32), axis=0) - 1
            tl.store(sorted_ptr + base + placed + rank, routes, mask=hit)
            placed += tl.sum(hit.to(tl.int32), axis=0)
        # Pad the last block with the sentinel route (fewer than BLOCK_M slots).
        slots = count + tl.arange(0, BLOCK_M)
        pad = tl.full([BLOCK_M], 0, tl.int32) + num_routes
        tl.store(sorted_ptr + base + slots, pad, mask=slots < num_blocks * BLOCK_M)
        for b in range(0, num_blocks, BLOCK_CHUNK):
            ids_out = b + tl.arange(0, BLOCK_CHUNK)
            mine = tl.full([BLOCK_CHUNK], 0, tl.int32) + expert
            tl.store(block_expert_ptr + first_block + ids_out, mine, mask=ids_out < num_blocks)
    else:
        # The extra program: blocks past the used ones have no expert.
        for b in range(first_block, max_blocks, BLOCK_CHUNK):
            ids_out = b + tl.arange(0, BLOCK_CHUNK)
            none = tl.full([BLOCK_CHUNK], -1, tl.int32)
            tl.store(block_expert_ptr + ids_out, none, mask=ids_out < max_blocks)


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc + a @ b in float32.

    Interpreted, the products are summed explicitly (in float32: half-precision products
    are exact there). The interpreter's tl.dot is numpy's matmul, whose BLAS kernel, and
    so each element's summation order, changes with the operands' shapes and layouts, so
    it would differ between route block sizes where the GPU's instructions do not; it
    also gets bfloat16 dots wrong. The explicit sum adds the k terms in order for every
    element whatever the tile's other sizes."""
    if INTERPRETED:
        prod = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]
        return acc + tl.sum(prod, axis=1)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _route_block(
    block,
    sorted_ptr,
    block_expert_ptr,
    ids_ptr,
    num_routes,
    top_k,
    stride_it,
    stride_ij,
    BLOCK_M: tl.constexpr,
    PAIRS: tl.constexpr,
):
    """(expert, routes [BLOCK_M]) of route block `block`; rows past the block's routes
    hold the sentinel `num_routes`.

    Sorted plan: both read from `align_routes`' buffers. Pairs plan (decode): block r is
    route r alone, expert topk_ids[r // k, r % k], read straight from the router's ids, so
    no sort is needed; the tile shapes stay those of the sorted plan's BLOCK_M."""
    if PAIRS:
        id_off = (block // top_k).to(tl.int64) * stride_it + (block % top_k) * stride_ij
        expert = tl.load(ids_ptr + id_off).to(tl.int32)
        routes = tl.where(tl.arange(0, BLOCK_M) == 0, block, num_routes)
    else:
        expert = tl.load(block_expert_ptr + block)
        routes = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, routes


@triton.jit(do_not_specialize=["num_routes"])
def _gate_up_kernel(
    x_ptr,
    w13_ptr,
    sorted_ptr,
    block_expert_ptr,
    ids_ptr,
    act_ptr,
    num_routes,
    top_k,
    num_experts,
    hidden_size,
    inter,
    stride_xt,
    stride_we,
    stride_wn,
    stride_act,
    stride_it,
    stride_ij,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    PAIRS: tl.constexpr,
):
    expert, routes = _route_block(
        tl.program_id(0),
        sorted_ptr,
        block_expert_ptr,
        ids_ptr,
        num_routes,
        top_k,
        stride_it,
        stride_ij,
        BLOCK_M,
        PAIRS,
    )
    # Unused sorted blocks carry -1; a pair's id out of [0, E) is skipped (never read).
    if (expert >= 0) & (expert < num_experts):
        valid = routes < num_routes
        tokens = (routes // top_k).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inter
        ks = tl.arange(0, BLOCK_K)
        gate_ptrs = w13_ptr + expert.to(tl.int64) * stride_we
        gate_ptrs = gate_ptrs + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
        up_ptrs = gate_ptrs + inter * stride_wn
        x_ptrs = x_ptr + tokens[:, None] * stride_xt + ks[None, :]
        acc_gate = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, hidden_size, BLOCK_K):
            k_ok = (k0 + ks) < hidden_size
            x = tl.load(x_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w_mask = col_ok[:, None] & k_ok[None, :]
            w_gate = tl.load(gate_ptrs, mask=w_mask, other=0.0)
            w_up = tl.load(up_ptrs, mask=w_mask, other=0.0)
            x_t = tl.trans(x)
            acc_gate = _dot(w_gate, x_t, acc_gate, DOT_PRECISION, INTERPRETED)
            acc_up = _dot(w_up, x_t, acc_up, DOT_PRECISION, INTERPRETED)
            x_ptrs += BLOCK_K
            gate_ptrs += BLOCK_K
            up_ptrs += BLOCK_K
        act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
        out_ptrs = act_ptr + routes[None, :].to(tl.int64) * stride_act + cols[:, None]
        tl.store(
            out_ptrs,
            act.to(act_ptr.dtype.element_ty),
            mask=col_ok[:, None] & valid[None, :],
        )


@triton.jit(do_not_specialize=["num_routes"])
def _down_kernel(
    act_ptr,
    w2_ptr,
    sorted_ptr,
    block_expert_ptr,
    ids_ptr,
    weights_ptr,
    routed_ptr,
    num_routes,
    top_k,
    num_experts,
    hidden_size,
    inter,
    stride_act,
    stride_we,
    stride_wn,
    stride_tw_t,
    stride_tw_j,
    stride_routed,
    stride_it,
    stride_ij,
    counters_ptr,
    out_ptr,
    stride_ct,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    PAIRS: tl.constexpr,
    SUM_SLOTS: tl.constexpr,
):
    expert, routes = _route_block(
        tl.program_id(0),
        sorted_ptr,
        block_expert_ptr,
        ids_ptr,
        num_routes,
        top_k,
        stride_it,
        stride_ij,
        BLOCK_M,
        PAIRS,
    )
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if (expert >= 0) & (expert < num_experts):
        valid = routes < num_routes
        routes64 = routes.to(tl.int64)
        col_ok = cols < hidden_size
        ks = tl.arange(0, BLOCK_K)
        w_ptrs = w2_ptr + expert.to(tl.int64) * stride_we
        w_ptrs = w_ptrs + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
        a_ptrs = act_ptr + routes64[:, None] * stride_act + ks[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k_ok = (k0 + ks) < inter
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _dot(w, tl.trans(a), acc, DOT_PRECISION, INTERPRETED)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        weight_offs = (routes // top_k).to(tl.int64) * stride_tw_t + (routes % top_k) * stride_tw_j
        weight = tl.load(weights_ptr + weight_offs, mask=valid, other=0.0).to(tl.float32)
        out_ptrs = routed_ptr + routes64[None, :] * stride_routed + cols[:, None]
        tl.store(out_ptrs, acc * weight[None, :], mask=col_ok[:, None] & valid[None, :])
    if SUM_SLOTS:
        # The pairs plan's slot sum in this launch (`uses_slot_sum`): route program r is
        # token r // k's slot r % k. Each of the token's k programs of this column tile
        # arrives at its counter once (an unplaced expert's too, which stored nothing);
        # the last to arrive sums the k slots by _sum_slots_kernel's code and sets
        # the counter back to 0 for the next launch. Every thread's stores before the
        # release; the acquire before the sum reads the other programs' rows.
        token = (tl.program_id(0) // top_k).to(tl.int64)
        count_ptr = counters_ptr + token * stride_ct + tl.program_id(1)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == top_k - 1:
            _store_slot_sum(
                routed_ptr,
                ids_ptr,
                out_ptr,
                token,
                cols,
                top_k,
                num_experts,
                hidden_size,
                stride_it,
                stride_ij,
                stride_out,
                BLOCK_N,
            )
            tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _store_slot_sum(
    routed_ptr,
    ids_ptr,
    out_ptr,
    token,
    cols,
    top_k,
    num_experts,
    hidden_size,
    stride_it,
    stride_ij,
    stride_out,
    BLOCK: tl.constexpr,
):
    """out[token, cols] = the sum over slots j = 0..k-1, in order, of token's routed rows
    (float32), rounded to out's dtype once; a slot whose expert is out of range adds zeros
    (it was never computed)."""
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for slot in range(0, top_k):
        expert = tl.load(ids_ptr + token * stride_it + slot * stride_ij)
        # (A mask from a comparison with a scalar bound: the interpreter rejects scalar &
        # vector.)
        placed = (expert >= 0) & (expert < num_experts)
        limit = tl.where(placed, hidden_size, 0)
        row = routed_ptr + (token * top_k + slot) * hidden_size
        total += tl.load(row + cols, mask=cols < limit, other=0.0)
    out = total.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * stride_out + cols, out, mask=cols < hidden_size)


@triton.jit
def _sum_slots_kernel(
    routed_ptr,
    ids_ptr,
    out_ptr,
    top_k,
    num_experts,
    hidden_size,
    stride_it,
    stride_ij,
    stride_out,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    _store_slot_sum(
        routed_ptr,
        ids_ptr,
        out_ptr,
        token,
        cols,
        top_k,
        num_experts,
        hidden_size,
        stride_it,
        stride_ij,
        stride_out,
        BLOCK_H,
    )


def _check_block_m(block_m) -> None:
    if isinstance(block_m, bool) or not isinstance(block_m, int):
        raise ValueError(f"block_m: expected an int in {BLOCK_M_CHOICES} or None, got {block_m!r}")
    if block_m not in BLOCK_M_CHOICES:
        raise ValueError(f"block_m: expected one of {BLOCK_M_CHOICES} or None, got {block_m}")


def align_routes(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, *, _fill: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorts the routes by expert on the device: returns (sorted_routes, block_expert).

    `sorted_routes` [max_route_blocks * block_m] int32 holds route indices (t * k + j)
    grouped by expert in ascending expert order, each expert's run starting on a block
    boundary and padded to whole blocks with the sentinel N = T * k; entries past the
    used blocks are unspecified. `block_expert` [max_route_blocks] int32 is each block's
    expert, -1 for unused blocks. `_fill` pre-fills both buffers (tests: to show that
    every entry read later is written)."""
    _check_block_m(block_m)
    num_routes = topk_ids.numel()
    max_blocks = max_route_blocks(num_routes, num_experts, block_m)
    device = topk_ids.device
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    sorted_routes = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    if _fill is not None:
        for buf in (counts, sorted_routes, block_expert):
            buf.fill_(_fill)
    if num_routes == 0:
        return sorted_routes, block_expert
    top_k = topk_ids.shape[1]
    strides = (topk_ids.stride(0), topk_ids.stride(1))
    _count_routes_kernel[(num_experts,)](
        topk_ids, counts, num_routes, top_k, *strides, ROUTE_CHUNK=ROUTE_CHUNK
    )
    _place_routes_kernel[(num_experts + 1,)](
        topk_ids,
        counts,
        sorted_routes,
        block_expert,
        num_routes,
        top_k,
        num_experts,
        max_blocks,
        *strides,
        BLOCK_M=block_m,
        EXPERTS_PAD=next_power_of_2(num_experts),
        ROUTE_CHUNK=ROUTE_CHUNK,
        BLOCK_CHUNK=BLOCK_CHUNK,
    )
    return sorted_routes, block_expert


def _check_triton_args(hidden, w13, w2, topk_weights, topk_ids) -> tuple[int, ...]:
    dims = check_moe_args(hidden, w13, w2, topk_weights, topk_ids)
    check_dtype("hidden", hidden)
    check_dtype("topk_weights", topk_weights)
    for name, tensor in (("hidden", hidden), ("w13", w13), ("w2", w2)):
        check_last_dim_contiguous(name, tensor)
    check_same_device(hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    return dims


def fused_moe_triton(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    block_m: int | None = None,
    pairs: bool | None = None,
    slot_sum: bool | None = None,
    _fill: float | None = None,
) -> torch.Tensor:
    """hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] (float32, or a
    half type, read as float32), topk_ids [T, k] int32/int64 -> [T, H] in hidden's dtype.

    `block_m` (16, 32 or 64) overrides the route block size `choose_block_m` picks; the
    answer is bitwise the same for each. `pairs` forces (True) or forbids (False) the
    decode plan without the route sort (`uses_pairs_plan` decides when None; it takes
    block_m 16 or None). `slot_sum` forces or forbids the pairs plan's slot sum inside its
    down launch (`uses_slot_sum` decides when None; the same bits). No host sync
    (CUDA-graph capturable). Ids out of [0, E) are not checked: such routes contribute
    nothing. `_fill` pre-fills the workspaces (tests: NaN shows any read of an unwritten
    element)."""
    num_tokens, hidden_size, num_experts, inter, top_k = _check_triton_args(
        hidden, w13, w2, topk_weights, topk_ids
    )
    sorted_block_m = choose_block_m(num_tokens, top_k, num_experts)
    block_m, pairs = plan_route_blocks(hidden, block_m, pairs, sorted_block_m)
    if slot_sum is None:
        slot_sum = uses_slot_sum(hidden, pairs)
    elif slot_sum and not pairs:
        raise ValueError("slot_sum: the in-launch slot sum needs the pairs plan (pairs=True)")
    out = torch.empty((num_tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    if num_tokens == 0 or hidden_size == 0:
        return out
    num_routes = num_tokens * top_k
    sorted_routes, block_expert, num_blocks = route_blocks(
        topk_ids, num_experts, block_m, pairs, _fill=None if _fill is None else -7
    )
    act = torch.empty((num_routes, inter), dtype=hidden.dtype, device=hidden.device)
    routed = torch.empty((num_routes, hidden_size), dtype=torch.float32, device=hidden.device)
    if _fill is not None:
        act.fill_(_fill)
        routed.fill_(_fill)
    dot_args = dict(
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",
        INTERPRETED=is_interpreted(_gate_up_kernel),
        PAIRS=pairs,
        num_warps=NUM_WARPS,
    )
    gate_up_grid = (num_blocks, triton.cdiv(inter, BLOCK_N))
    gate_up_stages, down_stages = (NUM_STAGES, NUM_STAGES)
    if pairs:
        # Half precision only: float32 tiles (forced pairs=True) at depth 6 would ask for
        # about 216 KB of shared memory.
        programs = gate_up_grid[0] * gate_up_grid[1]
        idle_sms = hidden.element_size() == 2 and programs <= sm_count(hidden.device)
        gate_up_stages, down_stages = pairs_stages(num_tokens, idle_sms)
    id_strides = (topk_ids.stride(0), topk_ids.stride(1))
    tiles = triton.cdiv(hidden_size, BLOCK_N)
    # Without the in-launch sum the kernel never reads its counters: topk_ids stands in.
    counters = slot_counters(hidden.device, num_tokens, tiles) if slot_sum else topk_ids
    _gate_up_kernel[gate_up_grid](
        hidden,
        w13,
        sorted_routes,
        block_expert,
        topk_ids,
        act,
        num_routes,
        top_k,
        num_experts,
        hidden_size,
        inter,
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        act.stride(0),
        *id_strides,
        **dot_args,
        num_stages=gate_up_stages,
    )
    _down_kernel[(num_blocks, triton.cdiv(hidden_size, BLOCK_N))](
        act,
        w2,
        sorted_routes,
        block_expert,
        topk_ids,
        topk_weights,
        routed,
        num_routes,
        top_k,
        num_experts,
        hidden_size,
        inter,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        topk_weights.stride(0),
        topk_weights.stride(1),
        routed.stride(0),
        *id_strides,
        counters,
        out,
        counters.stride(0),
        out.stride(0),
        **dot_args,
        SUM_SLOTS=bool(slot_sum),
        num_stages=down_stages,
    )
    if slot_sum:
        return out
    block_h = min(MAX_SUM_BLOCK, next_power_of_2(hidden_size))
    _sum_slots_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
        routed,
        topk_ids,
        out,
        top_k,
        num_experts,
        hidden_size,
        topk_ids.stride(0),
        topk_ids.stride(1),
        out.stride(0),
        BLOCK_H=block_h,
    )
    return out
