"""W4A16 fused mixture-of-experts: the Triton kernels (int4 experts, float activations).

Semantics and rounding points are `w4a16_moe.w4a16_fused_moe_ref`'s: each expert weight
tile is dequantized in the kernel exactly as `w4a16_gemm_triton.dequant_w4_tile` does
(rounded once to the hidden dtype), then the float MoE's sums follow (`fused_moe_triton`:
float32 accumulation, silu(gate) * up rounded once to the hidden dtype, the routing
weight applied in float32, a token's k contributions summed in slot order).

It reuses the float MoE's route alignment (`align_routes`) and slot sum; only the two
GEMM kernels differ, reading packed int32 words and group scales instead of float
weights. It also takes the float MoE's pairs (decode) plan (`fused_moe_triton`: each route
its own block, expert read from topk_ids, no count/place launches) where that would.

Route-block plans (seed 003's lesson, invariant 7): each (route block, N tile) program
decodes its expert's weight tile once for the block's BLOCK_M routes, so narrow blocks
re-decode an expert's weights ceil(routes / BLOCK_M) times. `choose_block_m` picks the
block from the launch shape: 16 rows at decode sizes (little padding), 32 and 64 as
tokens per expert grow (fewer decodes per expert). The plan depends on the launch shape
only, so a captured CUDA graph keeps its plan; at real MoE shapes (hundreds of experts)
every decode size gets the 16-row plan. Every plan gives bitwise the same output:
results are written by route index and each element is the same dot over the same K
tiles in the same order (BLOCK_N, BLOCK_K, warps, stages fixed); tested interpreted and
on the GPU.
"""

from __future__ import annotations

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
from kvloom.kernels.fused_moe_triton import (
    BLOCK_K,
    BLOCK_N,
    MAX_SUM_BLOCK,
    NUM_STAGES,
    NUM_WARPS,
    _dot,
    _route_block,
    _sum_slots_kernel,
    choose_block_m,
    plan_route_blocks,
    route_blocks,
)
from kvloom.kernels.w4a16_gemm_triton import dequant_w4_tile
from kvloom.kernels.w4a16_moe import check_w4a16_moe_args, check_w4a16_moe_offsets


@triton.jit(do_not_specialize=["num_routes"])
def _w4_gate_up_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    o_ptr,
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
    stride_se,
    stride_sn,
    stride_act,
    stride_it,
    stride_ij,
    GROUP: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
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
        e64 = expert.to(tl.int64)
        gate_rows = cols.to(tl.int64)
        up_rows = gate_rows + inter
        w_base = w_ptr + e64 * stride_we
        s_base = s_ptr + e64 * stride_se
        o_base = o_ptr + e64 * stride_se  # offsets: the scales' shape and strides
        acc_gate = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        dtype = x_ptr.dtype.element_ty
        for k0 in range(0, hidden_size, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < hidden_size
            x = tl.load(
                x_ptr + tokens[:, None] * stride_xt + kk[None, :],
                mask=valid[:, None] & k_ok[None, :],
                other=0.0,
            )
            w_gate = dequant_w4_tile(
                w_base + gate_rows * stride_wn,
                s_base + gate_rows * stride_sn,
                col_ok,
                k0,
                hidden_size,
                GROUP,
                BLOCK_K,
                dtype,
                o_base + gate_rows * stride_sn,
                HAS_OFFSET,
            )
            w_up = dequant_w4_tile(
                w_base + up_rows * stride_wn,
                s_base + up_rows * stride_sn,
                col_ok,
                k0,
                hidden_size,
                GROUP,
                BLOCK_K,
                dtype,
                o_base + up_rows * stride_sn,
                HAS_OFFSET,
            )
            x_t = tl.trans(x)
            acc_gate = _dot(w_gate, x_t, acc_gate, DOT_PRECISION, INTERPRETED)
            acc_up = _dot(w_up, x_t, acc_up, DOT_PRECISION, INTERPRETED)
        act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
        out_ptrs = act_ptr + routes[None, :].to(tl.int64) * stride_act + cols[:, None]
        tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=col_ok[:, None] & valid[None, :])


@triton.jit(do_not_specialize=["num_routes"])
def _w4_down_kernel(
    act_ptr,
    w_ptr,
    s_ptr,
    o_ptr,
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
    stride_se,
    stride_sn,
    stride_tw_t,
    stride_tw_j,
    stride_routed,
    stride_it,
    stride_ij,
    GROUP: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
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
        routes64 = routes.to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden_size
        ks = tl.arange(0, BLOCK_K)
        e64 = expert.to(tl.int64)
        rows = cols.to(tl.int64)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < inter
            a = tl.load(
                act_ptr + routes64[:, None] * stride_act + kk[None, :],
                mask=valid[:, None] & k_ok[None, :],
                other=0.0,
            )
            w = dequant_w4_tile(
                w_ptr + e64 * stride_we + rows * stride_wn,
                s_ptr + e64 * stride_se + rows * stride_sn,
                col_ok,
                k0,
                inter,
                GROUP,
                BLOCK_K,
                act_ptr.dtype.element_ty,
                o_ptr + e64 * stride_se + rows * stride_sn,
                HAS_OFFSET,
            )
            acc = _dot(w, tl.trans(a), acc, DOT_PRECISION, INTERPRETED)
        weight_offs = (routes // top_k).to(tl.int64) * stride_tw_t + (routes % top_k) * stride_tw_j
        weight = tl.load(weights_ptr + weight_offs, mask=valid, other=0.0).to(tl.float32)
        out_ptrs = routed_ptr + routes64[None, :] * stride_routed + cols[:, None]
        tl.store(out_ptrs, acc * weight[None, :], mask=col_ok[:, None] & valid[None, :])


def w4a16_fused_moe_triton(
    hidden: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    group_size: int,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_offset: torch.Tensor | None = None,
    w2_offset: torch.Tensor | None = None,
    block_m: int | None = None,
    pairs: bool | None = None,
    _fill: float | None = None,
) -> torch.Tensor:
    """hidden [T, H] -> [T, H] in hidden's dtype. `block_m` (16, 32 or 64) overrides the
    plan `choose_block_m` picks; `pairs` forces or forbids the float MoE's decode plan
    without the route sort (`fused_moe_triton.uses_pairs_plan` decides when None); the
    answer is bitwise the same for each. No host sync. `w13_offset` / `w2_offset`
    (float32, the scales' shapes; both or neither): zero points as offsets s * z, the
    weight then q * s - o (AWQ).
    Ids outside [0, E) contribute nothing (as `fused_moe_triton`). `_fill` pre-fills the
    workspaces (tests)."""
    num_experts, inter = check_w4a16_moe_args(
        hidden, w13_packed, w13_scale, w2_packed, w2_scale, group_size
    )
    has_offset = check_w4a16_moe_offsets(w13_scale, w2_scale, w13_offset, w2_offset)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0] or topk_ids.shape[1] == 0:
        raise ValueError(f"topk_ids: expected [{hidden.shape[0]}, k], got {list(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights: expected shape {list(topk_ids.shape)}")
    check_dtype("hidden", hidden)
    check_dtype("topk_weights", topk_weights)
    for name, tensor in (("hidden", hidden), ("w13_packed", w13_packed), ("w2_packed", w2_packed),
                         ("w13_scale", w13_scale), ("w2_scale", w2_scale)):  # fmt: skip
        check_last_dim_contiguous(name, tensor)
    check_same_device(hidden=hidden, w13=w13_packed, w2=w2_packed, topk_ids=topk_ids)
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    sorted_block_m = choose_block_m(num_tokens, top_k, num_experts)
    block_m, pairs = plan_route_blocks(hidden, block_m, pairs, sorted_block_m)
    out = torch.empty((num_tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    if num_tokens == 0 or hidden_size == 0:
        return out
    num_routes = num_tokens * top_k
    sorted_routes, block_expert, max_blocks = route_blocks(topk_ids, num_experts, block_m, pairs)
    act = torch.empty((num_routes, inter), dtype=hidden.dtype, device=hidden.device)
    routed = torch.empty((num_routes, hidden_size), dtype=torch.float32, device=hidden.device)
    if _fill is not None:
        act.fill_(_fill)
        routed.fill_(_fill)
    meta = dict(
        GROUP=group_size,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",
        INTERPRETED=is_interpreted(_w4_gate_up_kernel),
        PAIRS=pairs,
        HAS_OFFSET=has_offset,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    # Without offsets the scales stand in for them (never read: HAS_OFFSET is off).
    _w4_gate_up_kernel[(max_blocks, triton.cdiv(inter, BLOCK_N))](
        hidden,
        w13_packed,
        w13_scale,
        w13_offset if has_offset else w13_scale,
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
        w13_packed.stride(0),
        w13_packed.stride(1),
        w13_scale.stride(0),
        w13_scale.stride(1),
        act.stride(0),
        topk_ids.stride(0),
        topk_ids.stride(1),
        **meta,
    )
    _w4_down_kernel[(max_blocks, triton.cdiv(hidden_size, BLOCK_N))](
        act,
        w2_packed,
        w2_scale,
        w2_offset if has_offset else w2_scale,
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
        w2_packed.stride(0),
        w2_packed.stride(1),
        w2_scale.stride(0),
        w2_scale.stride(1),
        topk_weights.stride(0),
        topk_weights.stride(1),
        routed.stride(0),
        topk_ids.stride(0),
        topk_ids.stride(1),
        **meta,
    )
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
