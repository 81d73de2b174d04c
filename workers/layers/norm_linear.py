"""A decoder layer's RMSNorm and the projection that reads its output, as one call.

`hidden, residual = norm(hidden, residual)` followed by `proj(hidden)` is two launches at
decode sizes; kernels/ops.rms_norm_linear makes it one (the norm in the GEMV's prologue)
where the plain GEMV would run, bitwise the same. The models call `norm_linear` instead of
the two modules, and keep the two calls for what the op cannot fuse (a quantized
projection, a gathered output).
"""

from __future__ import annotations

import torch

from kvloom.kernels.ops import rms_norm_linear, rms_norm_linear_route, silu_and_mul
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
