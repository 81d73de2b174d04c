"""FP8 fused mixture-of-experts: the Triton kernels (e4m3 experts and activations).

Semantics are `fp8_moe.fp8_fused_moe_ref`'s: the hidden states are quantized per token
and g13 group once (`fp8_gemm_triton`'s quant kernel, bitwise the reference's); the
gate/up kernel scales each BLOCK_K tile's e4m3 dot by x_s * w_s and accumulates in
float32, writes silu(gate) * up per route in the hidden dtype; those activations are
quantized per route and g2 group by the same quant kernel; the down kernel does the same
group-scaled GEMM times the routing weight; the float MoE's slot sum finishes.

Routes are sorted by expert with the float MoE's `align_routes`, and the route block
(BLOCK_M) is chosen by tokens per expert from FP8's own plan table (`choose_fp8_block_m`); as
in the float MoE,
BLOCK_M is the only thing plans change, results are written by route index and each
element sums the same K tiles in the same order, so every plan gives bitwise the same
output (invariant 7); the plan depends on the launch shape only, so a captured CUDA graph
keeps its plan (at hundreds of experts, the narrow one for every decode size). At up to
`PAIRS_PLAN_MAX_TOKENS` tokens it takes the float MoE's pairs plan (`fused_moe_triton`:
each route its own block, expert read from topk_ids, no count/place launches), bitwise
the same too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.kernels.arg_checks_triton import (
    check_dtype,
    check_same_device,
    is_interpreted,
    next_power_of_2,
)
from kvloom.kernels.fp8_gemm_triton import (
    BLOCK_N,
    NUM_STAGES,
    NUM_WARPS,
    _dot_fp8,
    gemm_block_k,
    per_token_group_quant_fp8_triton,
)
from kvloom.kernels.fp8_moe import check_fp8_moe_args
from kvloom.kernels.fused_moe_triton import (
    MAX_SUM_BLOCK,
    _route_block,
    _sum_slots_kernel,
    plan_route_blocks,
    route_blocks,
)


def choose_fp8_block_m(num_tokens: int, top_k: int, num_experts: int) -> int:
    """The FP8 MoE's route block, from its own measured plan table (H200, Qwen3-Next's
    E=512 / top-10 / H=2048 / I=512; docs/benchmarks/quantization.md): 16 rows while
    experts see at most 2 routes each on average (up to 64 tokens there: 0.737 ms against
    0.752 for 32 rows), 32 above (128 tokens: 0.895 against 0.938; 1536: 1.053 against 1.128
    for 16 and 1.265 for 64). Unlike the W4A16 and float MoE (`choose_block_m`), whose
    weight decode favours 64-row blocks at prefill sizes, 64 never wins here. A function of
    the shape only, so a CUDA graph keeps its plan; every plan gives the same bits."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    return 16 if per_expert <= 2 else 32


@triton.jit
def _scaled_tile(w_ptrs, ws_ptrs, w_mask, ws_mask, x, x_s, INTERPRETED: tl.constexpr):
    """One K tile's group-scaled product: (w . x^T) * w_s * x_s, float32 [rows, routes]."""
    w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    w_s = tl.load(ws_ptrs, mask=ws_mask, other=0.0)
    zero = tl.zeros([w.shape[0], x.shape[0]], dtype=tl.float32)
    return _dot_fp8(w, tl.trans(x), zero, INTERPRETED) * w_s[:, None] * x_s[None, :]


@triton.jit(do_not_specialize=["num_routes"])
def _fp8_gate_up_kernel(
    xq_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    sorted_ptr,
    block_expert_ptr,
    ids_ptr,
    act_ptr,
    num_routes,
    top_k,
    num_experts,
    hidden_size,
    inter,
    group_size,
    stride_xq,
    stride_xs,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_act,
    stride_it,
    stride_ij,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
        acc_gate = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, hidden_size, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < hidden_size
            g = k0 // group_size
            x = tl.load(
                xq_ptr + tokens[:, None] * stride_xq + kk[None, :],
                mask=valid[:, None] & k_ok[None, :],
                other=0.0,
            )
            x_s = tl.load(xs_ptr + tokens * stride_xs + g, mask=valid, other=0.0)
            w_mask = col_ok[:, None] & k_ok[None, :]
            w_base = w_ptr + e64 * stride_we + kk[None, :]
            s_base = ws_ptr + e64 * stride_wse + g
            acc_gate += _scaled_tile(
                w_base + gate_rows[:, None] * stride_wn,
                s_base + gate_rows * stride_wsn,
                w_mask,
                col_ok,
                x,
                x_s,
                INTERPRETED,
            )
            acc_up += _scaled_tile(
                w_base + up_rows[:, None] * stride_wn,
                s_base + up_rows * stride_wsn,
                w_mask,
                col_ok,
                x,
                x_s,
                INTERPRETED,
            )
        act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
        out_ptrs = act_ptr + routes[None, :].to(tl.int64) * stride_act + cols[:, None]
        tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=col_ok[:, None] & valid[None, :])


@triton.jit(do_not_specialize=["num_routes"])
def _fp8_down_kernel(
    aq_ptr,
    as_ptr,
    w_ptr,
    ws_ptr,
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
    group_size,
    stride_aq,
    stride_as,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_tw_t,
    stride_tw_j,
    stride_routed,
    stride_it,
    stride_ij,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
        rows = cols.to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        e64 = expert.to(tl.int64)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < inter
            g = k0 // group_size
            a = tl.load(
                aq_ptr + routes64[:, None] * stride_aq + kk[None, :],
                mask=valid[:, None] & k_ok[None, :],
                other=0.0,
            )
            a_s = tl.load(as_ptr + routes64 * stride_as + g, mask=valid, other=0.0)
            acc += _scaled_tile(
                w_ptr + e64 * stride_we + rows[:, None] * stride_wn + kk[None, :],
                ws_ptr + e64 * stride_wse + rows * stride_wsn + g,
                col_ok[:, None] & k_ok[None, :],
                col_ok,
                a,
                a_s,
                INTERPRETED,
            )
        weight_offs = (routes // top_k).to(tl.int64) * stride_tw_t + (routes % top_k) * stride_tw_j
        weight = tl.load(weights_ptr + weight_offs, mask=valid, other=0.0).to(tl.float32)
        out_ptrs = routed_ptr + routes64[None, :] * stride_routed + cols[:, None]
        tl.store(out_ptrs, acc * weight[None, :], mask=col_ok[:, None] & valid[None, :])


def fp8_fused_moe_triton(
    hidden: torch.Tensor,
    w13_q: torch.Tensor,
    w13_s: torch.Tensor,
    w2_q: torch.Tensor,
    w2_s: torch.Tensor,
    group13: int,
    group2: int,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    block_m: int | None = None,
    pairs: bool | None = None,
    _fill: float | None = None,
) -> torch.Tensor:
    """hidden [T, H] -> [T, H] in hidden's dtype; `block_m` (16, 32, 64) overrides the
    plan, `pairs` forces or forbids the float MoE's decode plan without the route sort
    (`fused_moe_triton.uses_pairs_plan` decides when None), each giving bitwise the same
    output. No host sync. `_fill`: tests."""
    check_fp8_moe_args(hidden, w13_q, w13_s, w2_q, w2_s, group13, group2, topk_weights, topk_ids)
    check_dtype("hidden", hidden)
    check_dtype("topk_weights", topk_weights)
    check_same_device(hidden=hidden, w13=w13_q, w2=w2_q, topk_ids=topk_ids)
    num_tokens, hidden_size = hidden.shape
    num_experts, inter, top_k = w13_q.shape[0], w13_q.shape[1] // 2, topk_ids.shape[1]
    sorted_block_m = choose_fp8_block_m(num_tokens, top_k, num_experts)
    block_m, pairs = plan_route_blocks(hidden, block_m, pairs, sorted_block_m)
    out = torch.empty((num_tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    if num_tokens == 0 or hidden_size == 0:
        return out
    num_routes = num_tokens * top_k
    x_q, x_s = per_token_group_quant_fp8_triton(hidden.contiguous(), group13)
    sorted_routes, block_expert, max_blocks = route_blocks(topk_ids, num_experts, block_m, pairs)
    act = torch.empty((num_routes, inter), dtype=hidden.dtype, device=hidden.device)
    routed = torch.empty((num_routes, hidden_size), dtype=torch.float32, device=hidden.device)
    if _fill is not None:
        act.fill_(_fill)
        routed.fill_(_fill)
    meta = dict(
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        INTERPRETED=is_interpreted(_fp8_gate_up_kernel),
        PAIRS=pairs,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    _fp8_gate_up_kernel[(max_blocks, triton.cdiv(inter, BLOCK_N))](
        x_q,
        x_s,
        w13_q,
        w13_s,
        sorted_routes,
        block_expert,
        topk_ids,
        act,
        num_routes,
        top_k,
        num_experts,
        hidden_size,
        inter,
        group13,
        x_q.stride(0),
        x_s.stride(0),
        w13_q.stride(0),
        w13_q.stride(1),
        w13_s.stride(0),
        w13_s.stride(1),
        act.stride(0),
        topk_ids.stride(0),
        topk_ids.stride(1),
        BLOCK_K=gemm_block_k(group13, hidden_size),
        **meta,
    )
    a_q, a_s = per_token_group_quant_fp8_triton(act, group2)
    _fp8_down_kernel[(max_blocks, triton.cdiv(hidden_size, BLOCK_N))](
        a_q,
        a_s,
        w2_q,
        w2_s,
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
        group2,
        a_q.stride(0),
        a_s.stride(0),
        w2_q.stride(0),
        w2_q.stride(1),
        w2_s.stride(0),
        w2_s.stride(1),
        topk_weights.stride(0),
        topk_weights.stride(1),
        routed.stride(0),
        topk_ids.stride(0),
        topk_ids.stride(1),
        BLOCK_K=gemm_block_k(group2, inter),
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
