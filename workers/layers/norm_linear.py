"""A decoder layer's RMSNorm and the projection next to it, as one call.

`hidden, residual = norm(hidden, residual)` followed by `proj(hidden)` is two launches at
decode sizes; kernels/ops.rms_norm_linear makes it one (the norm in the GEMV's prologue)
where the plain GEMV would run, bitwise the same. The models call `norm_linear` instead of
the two modules, and keep the two calls for what the op cannot fuse (a quantized
projection, a gathered output). `linear_norm` is the other side: a layer's output
projection with the residual add and the norm after it (the norm in the GEMV's epilogue).
"""

from __future__ import annotations

import torch

from kvloom.kernels.ops import (
    linear_add_rms_norm,
    linear_route,
    linear_silu_and_mul,
    rms_norm_linear,
    rms_norm_linear_route,
    silu_and_mul,
)
from kvloom.workers.layers.norm import RMSNorm


def _from_weight(proj: torch.nn.Module) -> bool:
    """A projection the fused ops can run from its weight and bias: unquantized, its output
    not gathered across ranks (a column-parallel shard or a replicated layer)."""
    return proj.quant_method is None and not getattr(proj, "gather_output", False)


def norm_linear(
    norm: RMSNorm,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    proj: torch.nn.Module,
    *,
    silu_and_mul_out: bool = False,
    keep_normed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(proj(normed), residual, normed if keep_normed else None), where
    `normed, residual = norm(hidden, residual)` (the first layer, residual None: normed
    is norm(hidden) and hidden is the residual). `proj` is a linear layer with `weight`,
    `bias`, `quant_method` (ColumnParallelLinear, ReplicatedLinear ...); with
    `silu_and_mul_out` it is a gated MLP's [gate; up] projection and the result is
    silu(gate) * up, as GatedMLP computes it before its down projection."""
    if _from_weight(proj):
        y, new_residual, normed = rms_norm_linear(
            hidden,
            residual,
            norm.weight,
            norm.eps,
            proj.weight,
            proj.bias,
            weight_offset=norm.weight_offset,
            silu_and_mul=silu_and_mul_out,
            write_normed=keep_normed,
        )
        return y, hidden if residual is None else new_residual, normed
    if residual is None:
        residual, normed = hidden, norm(hidden)
    else:
        normed, residual = norm(hidden, residual)
    y = proj(normed)
    if silu_and_mul_out:
        y = silu_and_mul(y)
    return y, residual, normed if keep_normed else None


def norm_linear_route(
    norm: RMSNorm,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    proj: torch.nn.Module,
    *,
    top_k: int,
    renormalize: bool,
    shared_expert_weight: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """`norm_linear(..., keep_normed=True)` for a MoE layer's router GEMV `proj`, plus its
    softmax top-k routes (weights, ids) where the GEMV's launch also runs the router
    (ops.rms_norm_linear_route; the router's arguments as `route_softmax_topk` takes
    them); else None, and the layer routes the logits itself."""
    fused = None
    if _from_weight(proj):
        fused = rms_norm_linear_route(
            hidden, residual, norm.weight, norm.eps, proj.weight, proj.bias,
            top_k=top_k, renormalize=renormalize, shared_expert_weight=shared_expert_weight,
            weight_offset=norm.weight_offset,
        )  # fmt: skip
    if fused is None:
        y, residual, normed = norm_linear(norm, hidden, residual, proj, keep_normed=True)
        return y, residual, normed, None
    y, new_residual, normed, weights, ids = fused
    return y, hidden if residual is None else new_residual, normed, (weights, ids)


def _plain(proj: torch.nn.Module) -> bool:
    """`_from_weight`, and nothing after the GEMV: one rank (no all-reduce) and no bias
    (a row-parallel layer adds it after the reduction)."""
    tp = getattr(proj, "tp", None)
    return _from_weight(proj) and (tp is None or tp.world_size == 1) and proj.bias is None


def linear_norm(
    proj: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(normed, residual) of `norm(proj(x), residual)`, with the residual add and the norm
    in the projection's GEMV launch (ops.linear_add_rms_norm: bitwise the launches it
    replaces), where that fuses; None elsewhere: the caller runs `proj` and the norm
    (or `norm_linear`, which may put the norm in the next projection instead)."""
    if residual is None or not _plain(proj):
        return None
    fused = linear_add_rms_norm(
        x.reshape(-1, x.shape[-1]),
        proj.weight,
        None,
        residual.reshape(-1, residual.shape[-1]),
        norm.weight,
        norm.eps,
        norm.weight_offset,
    )
    if fused is None:
        return None
    normed, new_residual = fused
    return normed.view(residual.shape), new_residual.view(residual.shape)


def project(proj: torch.nn.Module, normed: torch.Tensor, *, silu_and_mul_out: bool = False):
    """proj(normed) on rows a fused norm already produced (`linear_norm`); with
    `silu_and_mul_out`, proj is a gated MLP's [gate; up] projection and the result
    silu(gate) * up (the activation in the GEMV's epilogue where norm_linear would)."""
    if not silu_and_mul_out:
        return proj(normed)
    if _from_weight(proj):
        return linear_silu_and_mul(normed, proj.weight, proj.bias)
    return silu_and_mul(proj(normed))


def route_normed(
    proj: torch.nn.Module,
    normed: torch.Tensor,
    *,
    top_k: int,
    renormalize: bool,
    shared_expert_weight: str | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(logits, routes) of a MoE layer's router GEMV on rows a fused norm produced: the
    routes (weights, ids) where the router runs in the GEMV's launch (ops.linear_route),
    else None and the layer routes the logits itself, as `norm_linear_route`."""
    fused = None
    if _from_weight(proj):
        fused = linear_route(
            normed, proj.weight, proj.bias, top_k=top_k, renormalize=renormalize,
            shared_expert_weight=shared_expert_weight,
        )  # fmt: skip
    if fused is None:
        return proj(normed), None
    logits, weights, ids = fused
    return logits, (weights, ids)
