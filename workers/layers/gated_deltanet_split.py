"""Gated DeltaNet with separate input projections (Qwen3.5's linear-attention layers).

Qwen3.5 projects q/k/v, z, b and a with four linears instead of Qwen3-Next's two
per-key-head-interleaved ones:
  in_proj_qkv  rows [all q (Hk*Dk) | all k (Hk*Dk) | all v (Hv*Dv)]: already the conv's
               channel order, so no per-group reordering is needed
  in_proj_z    [Hv*Dv]
  in_proj_b    [Hv]
  in_proj_a    [Hv]
Everything after the projections (conv, gates, delta rule, state pages, gated norm) is
GatedDeltaNet's. Tensor parallelism splits each part by heads; a rank's key heads and
value heads are the same key-head groups (value head j belongs to group j // (Hv / Hk)),
which is the split GatedDeltaNet's conv, A_log and dt_bias already use.
"""

from __future__ import annotations

import torch

from kvloom.workers.layers.gated_deltanet import FusedInputProjection, GatedDeltaNet
from kvloom.workers.layers.linear import ColumnParallelLinear, check_shape
from kvloom.workers.layers.tp_group import TPGroup


class MultiPartColumnLinear(ColumnParallelLinear):
    """A column-parallel linear whose parts (q, k, v) the checkpoint stores as ONE tensor
    (rows [part 0 | part 1 | ...]); each part is split over ranks on its own."""

    num_shards = 1  # one checkpoint tensor per parameter (weight_loader.expected_entries)

    def load_shard(self, param_name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        if shard != 0:
            raise ValueError(f"weight {param_name}: unexpected shard {shard}")
        if self.quant_method is not None and param_name != "bias":
            return self.quant_method.load_parts(self, param_name, loaded)
        check_shape(param_name, loaded, (sum(self.output_sizes), self.input_size))
        offset = 0
        for part, size in enumerate(self.output_sizes):
            super().load_shard(param_name, loaded[offset : offset + size], part)
            offset += size


class GatedDeltaNetSplit(GatedDeltaNet):
    """Qwen3.5's linear-attention layer; a cache layer exactly like GatedDeltaNet.

    Fused (float checkpoints): `in_proj` gives, on each rank, [q | k | v | z | b | a] of its
    heads in one GEMM; the gates read [b | a] as one group of all its value heads. Unfused
    (quantized): the four released linears and a cat of b and a."""

    checkpoint_projections = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    def _build_projections(self, config: dict, tp: TPGroup, dtype: torch.dtype) -> None:
        hidden = config["hidden_size"]
        num_k = config["linear_num_key_heads"]
        num_v = config["linear_num_value_heads"]
        key_dim, value_dim = num_k * self.head_k_dim, num_v * self.head_v_dim
        self.ba_group = self.num_v_heads  # [b | a]: this rank's value heads as one group
        if self.fused:
            sources = [([key_dim, key_dim, value_dim], 1), ([value_dim], 1), ([num_v], 1)]
            sources.append(([num_v], 1))
            self.in_proj = FusedInputProjection(hidden, sources, tp=tp, dtype=dtype)
            return
        self.in_proj_qkv = MultiPartColumnLinear(
            hidden, [key_dim, key_dim, value_dim], tp=tp, dtype=dtype
        )
        self.in_proj_z = ColumnParallelLinear(hidden, [value_dim], tp=tp, dtype=dtype)
        self.in_proj_b = ColumnParallelLinear(hidden, [num_v], tp=tp, dtype=dtype)
        self.in_proj_a = ColumnParallelLinear(hidden, [num_v], tp=tp, dtype=dtype)

    def _split_projections(self, hidden: torch.Tensor, projected: torch.Tensor | None = None):
        """-> mixed_qkv [T, C] (conv input, channels [q | k | v]), z [T, Hv, Dv], and
        [b | a] [T, 2 * Hv]: the parent's gate layout with all value heads in one group.
        `projected`: the fused in_proj's output, computed by the caller (fused only)."""
        if self.fused:
            return super()._split_projections(hidden, projected)
        tokens = hidden.shape[0]
        mixed = self.in_proj_qkv(hidden)
        z = self.in_proj_z(hidden).view(tokens, self.num_v_heads, self.head_v_dim)
        ba = torch.cat([self.in_proj_b(hidden), self.in_proj_a(hidden)], dim=-1)
        return mixed, z, ba
