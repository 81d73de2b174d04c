"""The kernels model code calls: Triton on CUDA (half/single precision), else the torch
reference with the same semantics (`dispatch.use_triton`). Triton modules are imported only
when chosen, so CPU-only installs never import triton."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvloom.contracts import envs
from kvloom.kernels import causal_conv1d as conv_ref
from kvloom.kernels import gated_delta_rule as gdn_ref
from kvloom.kernels import kda as kda_ref
from kvloom.kernels.activation import gated_add_ref, mul_sigmoid_ref, silu_and_mul_ref
from kvloom.kernels.dispatch import TRITON_DTYPES, batch_invariant, use_triton
from kvloom.kernels.fp8_gemm_dispatch import scaled_mm_blocker, try_fp8_linear_scaled_mm
from kvloom.kernels.gated_rms_norm import gated_rms_norm_ref
from kvloom.kernels.gdn_gates import gdn_gates_ref
from kvloom.kernels.gemv import (
    CONV_GEMV_MAX_M,
    GEMV_DISPATCH_MAX_M,
    NORM_GEMV_MAX_K,
    NORM_GEMV_MAX_M,
)
from kvloom.kernels.kda_gated_norm import kda_gated_norm_ref
from kvloom.kernels.kda_gates import kda_gates_ref
from kvloom.kernels.kv_cache_write import is_fp8, write_kv_cache_ref
from kvloom.kernels.mla_attention import mla_attention_ref, write_mla_cache_ref
from kvloom.kernels.moe_router import ROUTER_KERNEL_MAX_EXPERTS
from kvloom.kernels.paged_attention import paged_attention_ref
from kvloom.kernels.quant_gemv import QUANT_GEMV_MAX_M, gemv_group
from kvloom.kernels.rms_norm import rms_norm_ref
from kvloom.kernels.rotary import apply_rotary_ref


def rms_norm(x, weight, eps, residual=None, weight_offset: float = 0.0):
    if use_triton(x):
        from kvloom.kernels.rms_norm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual, weight_offset)
    return rms_norm_ref(x, weight, eps, residual, weight_offset)


def rms_norm_widened(x, weight, eps, residual=None, weight_offset: float = 0.0):
    """(out, residual out, out widened to float32) of `rms_norm`: on CUDA one launch stores
    both (no separate cast launch for a float32 reader; KVLOOM_UNFUSED=router_rows casts
    apart, the same values)."""
    if use_triton(x) and not envs.unfused("router_rows"):
        from kvloom.kernels.rms_norm_triton import rms_norm_triton

        widened = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        out, new_residual = rms_norm_triton(
            x, weight, eps, residual, weight_offset, out_float32=widened
        )
        return out, new_residual, widened
    out, new_residual = rms_norm(x, weight, eps, residual, weight_offset)
    return out, new_residual, out.to(torch.float32)


def apply_rotary(x, cos, sin, rotary_dim=None):
    if use_triton(x):
        from kvloom.kernels.rotary_triton import apply_rotary_triton

        return apply_rotary_triton(x, cos, sin, rotary_dim)
    return apply_rotary_ref(x, cos, sin, rotary_dim)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        from kvloom.kernels.activation_triton import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)


def gated_add(base: torch.Tensor, gate_logit: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """base + sigmoid(gate_logit) * x (gate_logit [T, 1]); one launch on CUDA."""
    if use_triton(base) and gate_logit.dtype == x.dtype == base.dtype:
        from kvloom.kernels.activation_triton import gated_add_triton

        return gated_add_triton(base, gate_logit, x)
    return gated_add_ref(base, gate_logit, x)


def _cache_readable(x: torch.Tensor, cache: torch.Tensor) -> bool:
    """The Triton cache kernels take a cache of x's dtype or an FP8 one."""
    return cache.dtype == x.dtype or is_fp8(cache.dtype)


def write_kv_cache(key, value, kv_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    """Stores this step's keys / values (quantized by k_scale / v_scale in an FP8 cache)."""
    if use_triton(key) and _cache_readable(key, kv_cache):
        from kvloom.kernels.kv_cache_write_triton import write_kv_cache_triton

        return write_kv_cache_triton(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    return write_kv_cache_ref(key, value, kv_cache, slot_mapping, k_scale, v_scale)


def paged_attention(
    q,
    kv_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    scale,
    sliding_window=None,
    kv_stride: int = 1,
    kv_offset: int = 0,
    max_query_len: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    split_decode=None,
):
    """The Triton kernel serves the whole cache and a DCP shard (kv_stride > 1) alike, with
    lengths on the device (CUDA graphs). A shard's float32 q over a half cache (its float32
    partials) reads the cache widened exactly. `max_query_len` (a true host-side bound,
    e.g. 1 for a decode-only step) lets the Triton path skip the launch for long rows.
    k_scale / v_scale dequantize an FP8 cache.
    The deterministic mode gives every row one plan (kernels/batch_invariant.py).
    `split_decode` (a ForwardBatch's DecodeSplit, set only for uniform-decode steps outside
    the deterministic mode) takes the batch-invariant split-KV decode kernel; the torch
    reference computes the same function either way."""
    widened = q.dtype == torch.float32 and kv_cache.dtype in (torch.bfloat16, torch.float16)
    if use_triton(q) and (_cache_readable(q, kv_cache) or widened):
        from kvloom.kernels.paged_attention_triton import paged_attention_triton

        if split_decode is not None:
            return _paged_attention_decode_split(
                q,
                kv_cache,
                block_tables,
                query_start_loc,
                seq_lens,
                scale,
                sliding_window,
                kv_stride,
                kv_offset,
                k_scale,
                v_scale,
                split_decode,
            )
        plan = None
        if batch_invariant():
            from kvloom.kernels.batch_invariant import attention_plan

            plan = attention_plan(q.shape[1] // kv_cache.shape[3], q.shape[2], q.dtype)

        return paged_attention_triton(
            q,
            kv_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            scale,
            sliding_window,
            max_query_len=max_query_len,
            k_scale=k_scale,
            v_scale=v_scale,
            kv_stride=kv_stride,
            kv_offset=kv_offset,
            _plan_override=plan,
        )
    return paged_attention_ref(
        q,
        kv_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        sliding_window,
        kv_stride=kv_stride,
        kv_offset=kv_offset,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def _paged_attention_decode_split(
    q,
    kv_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    scale,
    sliding_window,
    kv_stride,
    kv_offset,
    k_scale,
    v_scale,
    split_decode,
):
    """The split-KV decode, its partials in the step's scratch (a CUDA graph's) if any."""
    from kvloom.kernels import paged_attention_triton as kernel

    # Read per call (tests shrink the constant); the variable is for A/B timing.
    keys = envs.decode_keys_per_split() or kernel.decode_keys_per_split(kv_cache.shape[3])
    merge = kernel.uses_split_merge(q)  # read once here, passed on
    parts = part_lses = counters = None
    if split_decode.scratch is not None:
        slots = kernel.decode_split_slots(block_tables, kv_cache, keys)
        parts, part_lses = split_decode.scratch.buffers(slots, q)
        if merge:
            counters = split_decode.scratch.counters(kv_cache.shape[3], q)
    return kernel.paged_attention_decode_split_triton(
        q,
        kv_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        sliding_window,
        max_seq_len=split_decode.max_seq_len,
        parts=parts,
        part_lses=part_lses,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_stride=kv_stride,
        kv_offset=kv_offset,
        keys_per_split=keys,
        merge_in_launch=merge,
        counters=counters,
    )


def latent_cache_as_kv(latent_cache: torch.Tensor) -> torch.Tensor:
    """An MLA latent cache [blocks, block_size, W] seen as a paged KV cache
    [2, blocks, block_size, 1, W] whose keys and values are the same rows (stride 0): the
    paged attention kernel then computes the absorbed MLA attention, with the latent part of
    its output (the first r of W dimensions) the latent output."""
    blocks, block_size, width = latent_cache.shape
    stride_b, stride_o, _ = latent_cache.stride()
    return latent_cache.as_strided(
        (2, blocks, block_size, 1, width), (0, stride_b, stride_o, width, 1)
    )


def write_mla_cache(latent, k_pe, latent_cache, slot_mapping, kv_scale=1.0) -> None:
    """Writes each token's [latent | k_pe] row at its slot (slot < 0: padding, skipped);
    on CUDA through the KV-write kernel, with no host sync (CUDA graphs). An FP8 cache
    stores the row divided by kv_scale."""
    if use_triton(latent) and _cache_readable(latent, latent_cache):
        from kvloom.kernels.kv_cache_write_triton import write_kv_cache_triton

        row = torch.cat([latent, k_pe.to(latent.dtype)], dim=-1).unsqueeze(1)
        # Keys and values alias one row: both writes store the same bytes.
        cache = latent_cache_as_kv(latent_cache)
        return write_kv_cache_triton(row, row, cache, slot_mapping, kv_scale, kv_scale)
    return write_mla_cache_ref(latent, k_pe, latent_cache, slot_mapping, kv_scale)


def mla_attention(
    q_latent,
    q_pe,
    latent_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    scale,
    kv_scale: float = 1.0,
):
    """Absorbed MLA attention -> o_latent [T, H, r]. On CUDA the MLA kernel
    (`mla_attention_triton`: c loaded once as key and value, r and dr as separate dots,
    lengths on the device for CUDA graphs, one plan for every row). Elsewhere the
    reference. kv_scale dequantizes an FP8 cache. MLA never runs under DCP (the model
    runner refuses it), so there is no strided-shard path here."""
    if use_triton(q_latent) and _cache_readable(q_latent, latent_cache):
        from kvloom.kernels.mla_attention_triton import mla_attention_triton

        return mla_attention_triton(
            q_latent,
            q_pe,
            latent_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            scale,
            kv_scale,
        )[0]
    return mla_attention_ref(
        q_latent, q_pe, latent_cache, block_tables, query_start_loc, seq_lens, scale, kv_scale
    )[0]


def causal_conv1d_varlen(
    x, weight, bias, cu_seqlens, conv_state, has_initial_state, activation="silu"
):
    """Causal conv over packed sequences (prefill chunks) -> (y, new conv state). On CUDA
    the Triton kernel (parallel over tokens, lengths kept on the device); elsewhere the
    reference, which builds [T, K, C] windows and reads the bounds back."""
    if use_triton(x):
        from kvloom.kernels.causal_conv1d_triton import causal_conv1d_varlen_triton

        return causal_conv1d_varlen_triton(
            x, weight, bias, cu_seqlens, conv_state, has_initial_state, activation
        )
    return conv_ref.causal_conv1d_varlen(
        x, weight, bias, cu_seqlens, conv_state, has_initial_state, activation
    )


def causal_conv1d_update(x, weight, bias, conv_state_pool, state_indices, activation="silu"):
    if use_triton(x):
        from kvloom.kernels.causal_conv1d_triton import causal_conv1d_update_triton

        return causal_conv1d_update_triton(
            x, weight, bias, conv_state_pool, state_indices, activation
        )
    return conv_ref.causal_conv1d_update(
        x, weight, bias, conv_state_pool, state_indices, activation
    )


def recurrent_gated_delta_rule(
    q, k, v, g, beta, state, state_indices, *, scale=None, use_qk_l2norm=False
):
    # The Triton kernel computes in float32 and stores the state back in the pool's dtype
    # (float32 or, with linear_state_dtype, a half type), as the reference does.
    if use_triton(q) and state.dtype in TRITON_DTYPES:
        from kvloom.kernels.gated_delta_rule_triton import recurrent_gated_delta_rule_triton

        return recurrent_gated_delta_rule_triton(
            q, k, v, g, beta, state, state_indices, scale=scale, use_qk_l2norm=use_qk_l2norm
        )
    return gdn_ref.recurrent_gated_delta_rule(
        q, k, v, g, beta, state, state_indices, scale=scale, use_qk_l2norm=use_qk_l2norm
    )


def _takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` (outside the deterministic mode) runs the Triton GEMV."""
    return (
        x.dtype in (torch.bfloat16, torch.float16)
        and use_triton(x)
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and x.stride(-1) == 1
        and 1 <= x.numel() // max(x.shape[-1], 1) <= GEMV_DISPATCH_MAX_M
        and not envs.flag("KVLOOM_NO_GEMV")
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """y = x W^T (+ bias). Half-precision inputs of at most GEMV_DISPATCH_MAX_M rows on CUDA
    take the weight-streaming Triton GEMV, which reads the weight in one launch where
    cuBLAS picks split-K kernels plus a reduce launch; everything else (and
    KVLOOM_NO_GEMV=1) uses F.linear. The deterministic mode takes its fixed-tile GEMM."""
    if batch_invariant():
        from kvloom.kernels import batch_invariant as bi

        return bi.linear(x, weight, bias)
    if _takes_gemv(x, weight):
        from kvloom.kernels.gemv_triton import gemv_triton

        out = gemv_triton(x.reshape(-1, x.shape[-1]), weight, bias)
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """silu_and_mul(linear(x, weight, bias)) for a merged [gate; up] weight [2I, K]. Where
    `linear` takes the Triton GEMV, one launch applies the activation at the GEMV's store
    (bitwise the same result, no [.., 2I] intermediate); elsewhere, the two calls."""
    if not batch_invariant() and _takes_gemv(x, weight):
        from kvloom.kernels.gemv_triton import gemv_silu_and_mul_triton

        out = gemv_silu_and_mul_triton(x.reshape(-1, x.shape[-1]), weight, bias)
        return out.view(*x.shape[:-1], out.shape[-1])
    return silu_and_mul(linear(x, weight, bias))


def _takes_norm_gemv(x, residual, norm_weight, weight, silu: bool) -> bool:
    """Whether `rms_norm_linear` runs the GEMV with the norm in its prologue: where
    `linear` would run the GEMV on the norm's output, for inputs the prologue reads."""
    k = x.shape[-1]
    return (
        not batch_invariant()
        and _takes_gemv(x, weight)
        and x.numel() // max(k, 1) <= NORM_GEMV_MAX_M
        and 1 <= k <= NORM_GEMV_MAX_K
        and weight.shape[0] >= 1 + silu
        and weight.shape[0] % (1 + silu) == 0
        and norm_weight.dtype == x.dtype
        and norm_weight.is_contiguous()
        and (residual is None or (residual.dtype == x.dtype and residual.stride(-1) == 1))
        and not envs.unfused("norm_gemv")
    )


def rms_norm_linear(
    x,
    residual,
    norm_weight,
    eps,
    weight,
    bias=None,
    *,
    weight_offset: float = 0.0,
    silu_and_mul: bool = False,
    write_normed: bool = False,
):
    """`normed, new_residual = rms_norm(x, norm_weight, eps, residual, weight_offset)`, then
    `linear(normed, weight, bias)` (or `linear_silu_and_mul` for a [gate; up] weight).
    Returns (y, new_residual, normed if write_normed else None); new_residual is None
    without a residual, as rms_norm's. Where `linear` takes the GEMV, one launch does
    both (gemv_triton.rms_norm_gemv_triton: bitwise the two launches); elsewhere, the
    two calls, so CPU and prefill numerics are rms_norm's and linear's."""
    if _takes_norm_gemv(x, residual, norm_weight, weight, silu_and_mul):
        from kvloom.kernels.gemv_triton import rms_norm_gemv_triton

        rows = x.reshape(-1, x.shape[-1])
        res_rows = residual.reshape(-1, x.shape[-1]) if residual is not None else None
        y, new_res, normed = rms_norm_gemv_triton(
            rows,
            res_rows,
            norm_weight,
            eps,
            weight,
            bias,
            weight_offset=weight_offset,
            silu_and_mul=silu_and_mul,
            write_normed=write_normed,
        )
        y = y.view(*x.shape[:-1], y.shape[-1])
        new_res = new_res.view(x.shape) if new_res is not None else None
        return y, new_res, normed.view(x.shape) if normed is not None else None
    normed, new_res = rms_norm(x, norm_weight, eps, residual, weight_offset)
    project = linear_silu_and_mul if silu_and_mul else linear
    return project(normed, weight, bias), new_res, normed if write_normed else None


def _takes_gemv_route(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm_linear_route` runs the router in the router GEMV's launch: where
    `linear` would run the GEMV on one row (at two an H100 timed the fused launch at 13.20
    us against 9.91 for the two launches: its last program routes the rows in turn; at one
    7.99 against 8.99), for at most the router kernel's experts, unless KVLOOM_UNFUSED
    names router_gemv."""
    return (
        not batch_invariant()
        and x.dim() == 2
        and x.shape[0] == 1
        and _takes_gemv(x, weight)
        and weight.shape[0] <= ROUTER_KERNEL_MAX_EXPERTS + 1
        and not envs.unfused("router_gemv")
    )


def rms_norm_linear_route(
    x,
    residual,
    norm_weight,
    eps,
    weight,
    bias,
    *,
    top_k: int,
    renormalize: bool,
    shared_expert_weight: str | None = None,
    weight_offset: float = 0.0,
):
    """A MoE layer's norm, router GEMV and softmax top-k router (kernels/moe_router):
    (logits, new_residual, normed, weights, ids) where the router runs in the GEMV's launch
    (gemv_triton.gemv_route_triton: bitwise the GEMV and router launches), with the norm
    in its prologue where `rms_norm_linear` would fuse that; None elsewhere (the caller
    runs `rms_norm_linear` and its router)."""
    if not _takes_gemv_route(x, weight):
        return None
    from kvloom.kernels import gemv_triton

    route = dict(top_k=top_k, renormalize=renormalize, shared_expert_weight=shared_expert_weight)
    if _takes_norm_gemv(x, residual, norm_weight, weight, False):
        return gemv_triton.rms_norm_gemv_route_triton(
            x, residual, norm_weight, eps, weight, bias, weight_offset=weight_offset,
            write_normed=True, **route,
        )  # fmt: skip
    normed, new_residual = rms_norm(x, norm_weight, eps, residual, weight_offset)
    logits, weights, ids = gemv_triton.gemv_route_triton(normed, weight, bias, **route)
    return logits, new_residual, normed, weights, ids


def _takes_gemv_conv(x, weight, conv_weight, conv_state_pool) -> bool:
    """Whether `rms_norm_linear_conv` runs the conv in the GEMV's epilogue: where `linear`
    would run the GEMV on [T, K] rows, at most CONV_GEMV_MAX_M of them, for conv weights
    and pools the kernel reads, unless KVLOOM_UNFUSED names gdn_conv."""
    return (
        not batch_invariant()
        and x.dim() == 2
        and _takes_gemv(x, weight)
        and x.shape[0] <= CONV_GEMV_MAX_M
        and conv_weight.dtype in TRITON_DTYPES
        and conv_state_pool.dtype in TRITON_DTYPES
        and 1 <= conv_weight.shape[0] <= weight.shape[0]
        and not envs.unfused("gdn_conv")
    )


def rms_norm_linear_conv(
    x,
    residual,
    norm_weight,
    eps,
    weight,
    bias,
    conv_weight,
    conv_state_pool,
    state_indices,
    *,
    weight_offset: float = 0.0,
    activation: str | None = "silu",
):
    """Gated DeltaNet's decode projection: `rms_norm_linear` (x [T, K]), then
    `causal_conv1d_update` on the first C = conv_weight.shape[0] columns of its output
    (the conv channels), the pool updated in place at state_indices (-1: padding row).
    Returns (y [T, N], new_residual, conv output [T, C]). Where the GEMV runs, the conv
    runs in its epilogue (gemv_triton: bitwise the separate launches), with the norm in
    its prologue where `rms_norm_linear` would fuse that: one launch. Elsewhere (and
    with KVLOOM_UNFUSED=gdn_conv) the two calls, so CPU numerics are the references'."""
    if _takes_gemv_conv(x, weight, conv_weight, conv_state_pool):
        from kvloom.kernels import gemv_triton

        conv_args = (conv_weight, conv_state_pool, state_indices)
        if _takes_norm_gemv(x, residual, norm_weight, weight, False):
            return gemv_triton.rms_norm_gemv_conv_triton(
                x, residual, norm_weight, eps, weight, bias, *conv_args,
                weight_offset=weight_offset, activation=activation,
            )  # fmt: skip
        normed, new_residual = rms_norm(x, norm_weight, eps, residual, weight_offset)
        y, conv = gemv_triton.gemv_conv_triton(
            normed, weight, bias, *conv_args, activation=activation
        )
        return y, new_residual, conv
    y, new_residual, _ = rms_norm_linear(
        x, residual, norm_weight, eps, weight, bias, weight_offset=weight_offset
    )
    channels = conv_weight.shape[0]
    conv = causal_conv1d_update(
        y[:, :channels], conv_weight, None, conv_state_pool, state_indices, activation
    )
    return y, new_residual, conv


def gdn_gates(ba, A_log, dt_bias, group_v_heads):
    """Gated DeltaNet's decay g (float32) and beta from the in_proj_ba output, read in place."""
    if use_triton(ba):
        from kvloom.kernels.gdn_gates_triton import gdn_gates_triton

        return gdn_gates_triton(ba, A_log, dt_bias, group_v_heads)
    return gdn_gates_ref(ba, A_log, dt_bias, group_v_heads)


def kda_gates(raw_gate, A_log, dt_bias, beta_logits):
    """Kimi Delta Attention's log-decay g [T, H, Dk] (float32) and beta [T, H] (beta_logits'
    dtype) in one launch on CUDA, reading the strided beta_logits view in place."""
    if use_triton(raw_gate) and beta_logits.dtype in TRITON_DTYPES:
        from kvloom.kernels.kda_gates_triton import kda_gates_triton

        return kda_gates_triton(raw_gate, A_log, dt_bias, beta_logits)
    return kda_gates_ref(raw_gate, A_log, dt_bias, beta_logits)


def kda_gated_norm(x, gate, weight, eps):
    """KDA's output norm, weight * rmsnorm(x) * sigmoid(gate) per head in float32: one
    launch at decode where the decode fusions apply (half precision on CUDA, decode rows,
    not the deterministic mode) unless KVLOOM_UNFUSED names kda_norm; elsewhere the torch
    composition (~12 launches), so CPU and prefill numerics stay the reference's."""
    fused = _decode_fusion(x) and gate.dtype == x.dtype and weight.dtype in TRITON_DTYPES
    if fused and not envs.unfused("kda_norm"):
        from kvloom.kernels.kda_gated_norm_triton import kda_gated_norm_triton

        return kda_gated_norm_triton(x, gate, weight, eps)
    return kda_gated_norm_ref(x, gate, weight, eps)


def gated_rms_norm(x, gate, weight, eps):
    """RMSNorm per head times silu(gate); the gate may be a strided [T, Hk, r, D] view."""
    if use_triton(x):
        from kvloom.kernels.gated_rms_norm_triton import gated_rms_norm_triton

        return gated_rms_norm_triton(x, gate, weight, eps)
    return gated_rms_norm_ref(x, gate, weight, eps)


def gdn_decode_step(
    q, k, v, ba, A_log, dt_bias, ba_group, state, state_indices, z, norm_weight, norm_eps
):
    """Gated DeltaNet's decode step after the conv: gdn_gates, recurrent_gated_delta_rule
    (q, k L2-normalised) and gated_rms_norm -> the normed output [N, Hv, Dv]. Where the
    Triton decode kernel runs, one launch computes the gates in the recurrence and the norm
    at its store where a value head fits one program's tile (up to 64 x 64; Qwen3-Next's
    128 x 128 heads take the faster narrow tiles and a separate norm: two launches), bit
    for bit the three launches; elsewhere the three calls as they were."""
    fused = use_triton(q) and use_triton(ba) and state.dtype in TRITON_DTYPES
    if fused and not envs.unfused("gdn_decode"):
        from kvloom.kernels.gated_delta_rule_triton import gdn_decode_triton

        return gdn_decode_triton(
            q, k, v, ba, A_log, dt_bias, ba_group, state, state_indices, z, norm_weight,
            norm_eps, use_qk_l2norm=True,
        )  # fmt: skip
    g, beta = gdn_gates(ba, A_log, dt_bias, ba_group)
    core = recurrent_gated_delta_rule(q, k, v, g, beta, state, state_indices, use_qk_l2norm=True)
    return gated_rms_norm(core, z, norm_weight, norm_eps)


def kda_decode_step(
    q, k, v, raw_gate, A_log, dt_bias, beta_logits, state, state_indices, gate, norm_weight,
    norm_eps,
):  # fmt: skip
    """KDA's decode step after the conv: kda_gates, recurrent_kda (q, k L2-normalised) and
    the output norm kda_gated_norm -> the normed output [N, H, Dv] in q's dtype. Where
    the decode fusions apply (half precision on CUDA, decode rows, not the deterministic
    mode) one launch computes the gates in the recurrence and the norm at its store (two
    where a value head is too wide for one program), bit for bit the three Triton
    launches; elsewhere, or where KVLOOM_UNFUSED names kda_decode (or kda_norm), the three
    calls as they were."""
    fused = (
        _decode_fusion(q)
        and state.dtype in TRITON_DTYPES
        and gate.dtype == q.dtype
        and norm_weight.dtype in TRITON_DTYPES
        and not envs.unfused("kda_decode")
        and not envs.unfused("kda_norm")
    )
    if fused:
        from kvloom.kernels.gated_delta_rule_triton import kda_decode_triton

        return kda_decode_triton(
            q, k, v, raw_gate, A_log, dt_bias, beta_logits, state, state_indices, gate,
            norm_weight, norm_eps, use_qk_l2norm=True,
        )  # fmt: skip
    g, beta = kda_gates(raw_gate, A_log, dt_bias, beta_logits)
    core = recurrent_kda(q, k, v, g, beta, state, state_indices, use_qk_l2norm=True)
    return kda_gated_norm(core.to(q.dtype), gate, norm_weight, norm_eps)


def recurrent_kda(q, k, v, g, beta, state, state_indices, *, scale=None, use_qk_l2norm=False):
    """KDA decode step (per-channel decay), in place on the pool: Triton on CUDA."""
    if use_triton(q) and state.dtype in TRITON_DTYPES:
        from kvloom.kernels.gated_delta_rule_triton import recurrent_kda_triton

        return recurrent_kda_triton(
            q, k, v, g, beta, state, state_indices, scale=scale, use_qk_l2norm=use_qk_l2norm
        )
    return kda_ref.recurrent_kda(
        q, k, v, g, beta, state, state_indices, scale=scale, use_qk_l2norm=use_qk_l2norm
    )


# Activation dtypes that take fla's prefill kernels by default. fla also takes float32, but
# its tl.dot rounds through TF32 there: a float32 model stays on the exact reference (on the
# H200, Kimi-Linear's float32 greedy tokens left the CPU reference's at step 10 on fla).
FLA_DISPATCH_DTYPES = (torch.float16, torch.bfloat16)


def _takes_fla(q) -> bool:
    """Whether a linear-attention prefill takes fla-core's kernels: a 16-bit CUDA tensor,
    fla installed, and not KVLOOM_NO_FLA=1."""
    from kvloom.kernels.gated_delta_rule_fla import fla_available

    return (
        isinstance(q, torch.Tensor)
        and q.is_cuda
        and q.dtype in FLA_DISPATCH_DTYPES
        and fla_available()
        and not envs.flag("KVLOOM_NO_FLA")
    )


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    cu_seqlens,
    initial_state=None,
    has_initial_state=None,
    *,
    scale=None,
    use_qk_l2norm=False,
    cu_seqlens_device=None,
):
    """Gated DeltaNet prefill: fla-core's chunked kernels on CUDA when installed (set
    KVLOOM_NO_FLA=1 to force the reference), else the torch reference.
    `cu_seqlens_device`: the same bounds on the device, one object for every layer of a
    step (fla then waits for the stream once per step, not per layer)."""
    if _takes_fla(q):
        from kvloom.kernels.gated_delta_rule_fla import chunk_gated_delta_rule_fla

        return chunk_gated_delta_rule_fla(
            q,
            k,
            v,
            g,
            beta,
            cu_seqlens,
            initial_state,
            has_initial_state,
            scale=scale,
            use_qk_l2norm=use_qk_l2norm,
            cu_seqlens_device=cu_seqlens_device,
        )
    return gdn_ref.chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        cu_seqlens,
        initial_state,
        has_initial_state,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
    )


def chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    cu_seqlens,
    initial_state=None,
    has_initial_state=None,
    *,
    scale=None,
    use_qk_l2norm=False,
    cu_seqlens_device=None,
):
    """KDA prefill (Kimi-Linear): fla-core's chunked kernels on CUDA when installed (not
    KVLOOM_NO_FLA=1), else the torch reference. `cu_seqlens_device`: as for
    `chunk_gated_delta_rule`."""
    if _takes_fla(q):
        from kvloom.kernels.kda_fla import chunk_kda_fla

        return chunk_kda_fla(
            q, k, v, g, beta, cu_seqlens, initial_state, has_initial_state,
            scale=scale, use_qk_l2norm=use_qk_l2norm, cu_seqlens_device=cu_seqlens_device,
        )  # fmt: skip
    return kda_ref.chunk_kda(
        q, k, v, g, beta, cu_seqlens, initial_state, has_initial_state,
        scale=scale, use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip


def fused_moe(hidden, w13, w2, topk_weights, topk_ids):
    """The routed experts' sum. Triton on CUDA (no host sync: CUDA-graph safe, one answer
    whatever its route block size); the reference elsewhere."""
    if use_triton(hidden):
        from kvloom.kernels.fused_moe_triton import fused_moe_triton

        return fused_moe_triton(hidden, w13, w2, topk_weights, topk_ids)
    from kvloom.kernels.fused_moe import fused_moe_ref

    return fused_moe_ref(hidden, w13, w2, topk_weights, topk_ids)


def qk_norm_rope(
    q,
    k,
    positions,
    cos_table,
    sin_table,
    q_weight,
    k_weight,
    eps,
    rotary_dim=None,
    weight_offset: float = 0.0,
):
    """Per-head RMSNorm of q and k (skipped where the weight is None), then rotary: one
    launch on CUDA instead of six."""
    if use_triton(q) and (q_weight is None or q_weight.dtype == q.dtype):
        from kvloom.kernels.qk_norm_rope_triton import qk_norm_rope_triton

        return qk_norm_rope_triton(
            q,
            k,
            positions,
            cos_table,
            sin_table,
            q_weight,
            k_weight,
            eps,
            rotary_dim,
            weight_offset,
        )
    from kvloom.kernels.qk_norm_rope import qk_norm_rope_ref

    return qk_norm_rope_ref(
        q, k, positions, cos_table, sin_table, q_weight, k_weight, eps, rotary_dim, weight_offset
    )


def _decode_fusion(x: torch.Tensor) -> bool:
    """Whether a decode-only fused launch replaces separate ones: as the Triton GEMV, half
    precision on CUDA at GEMV_DISPATCH_MAX_M rows at most, outside the deterministic mode
    (which keeps its one plan per op)."""
    return (
        x.dtype in (torch.bfloat16, torch.float16)
        and use_triton(x)
        and 1 <= x.shape[0] <= GEMV_DISPATCH_MAX_M
        and not batch_invariant()
    )


def qk_norm_rope_try_kv_write(
    q,
    k,
    v,
    positions,
    cos_table,
    sin_table,
    q_weight,
    k_weight,
    eps,
    rotary_dim,
    weight_offset,
    kv_cache,
    slot_mapping,
    k_scale=1.0,
    v_scale=1.0,
):
    """`qk_norm_rope`, and where the decode fusion applies (CUDA, half precision, decode
    rows, a cache the kernel writes) the cache write of the finished keys and v [T, Hk, D]
    in the same launch, bitwise `write_kv_cache`'s. Returns (q, k, written): when written is
    False only the norm + rotary ran and the caller writes the cache as before."""
    same_dtypes = v.dtype == q.dtype and (q_weight is None or q_weight.dtype == q.dtype)
    fused = _decode_fusion(q) and same_dtypes and _cache_readable(q, kv_cache)
    if fused and not envs.unfused("kv_write"):
        from kvloom.kernels.qk_norm_rope_triton import qk_norm_rope_kv_write_triton

        q, k = qk_norm_rope_kv_write_triton(
            q, k, v, positions, cos_table, sin_table, q_weight, k_weight, eps, rotary_dim,
            weight_offset, kv_cache, slot_mapping, k_scale, v_scale,
        )  # fmt: skip
        return q, k, True
    args = (positions, cos_table, sin_table, q_weight, k_weight, eps, rotary_dim, weight_offset)
    return *qk_norm_rope(q, k, *args), False


def mul_sigmoid(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [T, H * D] * sigmoid(gate [T, H, D], read in place from a strided view): one launch
    at decode on CUDA instead of copy, sigmoid and multiply; elsewhere torch's expression."""
    if _decode_fusion(x) and gate.dtype == x.dtype and not envs.unfused("mul_sigmoid"):
        from kvloom.kernels.activation_triton import mul_sigmoid_triton

        return mul_sigmoid_triton(x, gate)
    return mul_sigmoid_ref(x, gate)


def greedy_argmax(logits):
    """Per row, the NaN-safe greedy token (NaN never wins, the first +inf does, a row of
    only -inf/NaN picks 0, ties go to the smallest index), int64 [rows] on the logits'
    device. One or two launches on CUDA instead of ~10 full-size temporaries; no host sync."""
    from kvloom.kernels.greedy_argmax import check_greedy_logits, greedy_argmax_ref

    check_greedy_logits(logits)  # first, so a non-tensor is reported as `logits`
    if use_triton(logits):
        from kvloom.kernels.greedy_argmax_triton import greedy_argmax_triton

        return greedy_argmax_triton(logits)
    return greedy_argmax_ref(logits)


def apply_token_bitmask_(logits, bitmask, rows=None):
    """In place: -inf at every token the int32 bitmask of `rows[m]`'s mask m disallows
    (kernels/token_bitmask.py). One launch on CUDA, no host sync."""
    if use_triton(logits):
        from kvloom.kernels.token_bitmask_triton import apply_token_bitmask_triton

        return apply_token_bitmask_triton(logits, bitmask, rows)
    from kvloom.kernels.token_bitmask import apply_token_bitmask_ref

    return apply_token_bitmask_ref(logits, bitmask, rows)


# -- quantized weights (workers/layers/quantization) ---------------------------------------


def _quant_gemv(x: torch.Tensor, group_size: int, packed: bool, *tensors: torch.Tensor) -> bool:
    """Whether a quantized linear on the Triton path takes the weight-streaming GEMV
    (kernels/quant_gemv_triton.py): 1..QUANT_GEMV_MAX_M rows, contiguous weight and
    scales, a group layout it reads; not under KVLOOM_NO_GEMV=1, nor in the deterministic
    mode (which refuses quantized checkpoints; its GEMM path is left as it was)."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        1 <= rows <= QUANT_GEMV_MAX_M
        and not batch_invariant()
        and not envs.flag("KVLOOM_NO_GEMV")
        and all(t.is_contiguous() for t in tensors)
        and gemv_group(group_size, x.shape[-1], packed) is not None
    )


def fp8_linear(
    x, w_q, w_s, group_size, input_scale=None, bias=None, out_dtype=None, block_scale=None
):
    """y = x W^T for e4m3 W with per-row group scales (kernels/fp8_gemm.py). Triton on CUDA,
    else the reference. At decode sizes (`_quant_gemv`) a weight-only GEMV (activations
    not quantized: kernels/quant_gemv.py); otherwise activations are quantized to e4m3.
    `block_scale`: the weight's scale as [N / 128, K / 128] blocks, where the layer keeps
    it; with it, prefill sizes on Hopper take cuBLAS's blockwise FP8 GEMM
    (kernels/fp8_gemm_dispatch.py), the Triton GEMM where cuBLAS does not apply."""
    if use_triton(x) and input_scale is None:
        if _quant_gemv(x, group_size, False, w_q, w_s):
            from kvloom.kernels.quant_gemv_triton import fp8_gemv_triton

            return fp8_gemv_triton(x, w_q, w_s, group_size, bias, out_dtype)
        if scaled_mm_blocker(x, w_q, group_size, block_scale, out_dtype) is None:
            out = try_fp8_linear_scaled_mm(x, w_q, block_scale, bias, out_dtype)
            if out is not None:
                return out
        from kvloom.kernels.fp8_gemm_triton import fp8_linear_triton

        return fp8_linear_triton(x, w_q, w_s, group_size, bias, out_dtype)
    from kvloom.kernels.fp8_gemm import fp8_linear_ref

    return fp8_linear_ref(x, w_q, w_s, group_size, input_scale, bias, out_dtype)


def w4a16_linear(x, packed, scale, group_size, bias=None, out_dtype=None):
    """y = x W^T for int4 group-quantized W, dequantized in the kernel (w4a16_gemm.py);
    the weight-streaming GEMV at decode sizes (`_quant_gemv`); at prefill sizes the
    weight dequantized once, then cuBLAS (kernels/w4a16_dispatch.py); same semantics."""
    if use_triton(x):
        if _quant_gemv(x, group_size, True, packed, scale):
            from kvloom.kernels.quant_gemv_triton import w4a16_gemv_triton

            return w4a16_gemv_triton(x, packed, scale, group_size, bias, out_dtype)
        from kvloom.kernels import w4a16_dispatch

        if w4a16_dispatch.dequant_gemm_blocker(x, out_dtype) is None:
            return w4a16_dispatch.w4a16_linear_dequant(x, packed, scale, group_size, bias)
        from kvloom.kernels.w4a16_gemm_triton import w4a16_linear_triton

        return w4a16_linear_triton(x, packed, scale, group_size, bias, out_dtype)
    from kvloom.kernels.w4a16_gemm import w4a16_linear_ref

    return w4a16_linear_ref(x, packed, scale, group_size, bias, out_dtype)


def w4a16_fused_moe(
    hidden, w13_packed, w13_scale, w2_packed, w2_scale, group, weights, ids, offsets=None
):
    """Routed experts with int4 weights; the route block size is chosen by token count
    and every choice gives the same bits (invariant 7). `offsets`: (w13, w2) zero points
    as float32 s * z (AWQ), or None."""
    w13_offset, w2_offset = offsets or (None, None)
    zero_points = dict(w13_offset=w13_offset, w2_offset=w2_offset)
    if use_triton(hidden):
        from kvloom.kernels.w4a16_moe_triton import w4a16_fused_moe_triton

        return w4a16_fused_moe_triton(
            hidden, w13_packed, w13_scale, w2_packed, w2_scale, group, weights, ids, **zero_points
        )
    from kvloom.kernels.w4a16_moe import w4a16_fused_moe_ref

    return w4a16_fused_moe_ref(
        hidden, w13_packed, w13_scale, w2_packed, w2_scale, group, weights, ids, **zero_points
    )


def fp8_fused_moe(hidden, w13_q, w13_s, w2_q, w2_s, group13, group2, weights, ids):
    """Routed experts with e4m3 weights and activations (kernels/fp8_moe.py)."""
    if use_triton(hidden):
        from kvloom.kernels.fp8_moe_triton import fp8_fused_moe_triton

        return fp8_fused_moe_triton(hidden, w13_q, w13_s, w2_q, w2_s, group13, group2, weights, ids)
    from kvloom.kernels.fp8_moe import fp8_fused_moe_ref

    return fp8_fused_moe_ref(hidden, w13_q, w13_s, w2_q, w2_s, group13, group2, weights, ids)
