"""Tensor parallelism of quantized layers: weights AND scales shard together.

A block of the layers a decoder uses (fused QKV, row-parallel o_proj, a gate+up / down
MLP, fused MoE experts) is loaded from the same quantized tensors on one rank and on two
gloo ranks; every output must agree (float32: partial sums of the row-parallel layers
cross ranks in a different order, 1e-5 relative). Block scales shard by block (128-row
and 128-column blocks: column-parallel rows keep their block's scale row, row-parallel
ranks take whole column blocks), int4 packs and group scales by whole groups (GPTQ's
too, after their tensors become the W4A16 layout; AWQ's zero-point offsets shard as its
scales).

(Per-channel FP8 with dynamic per-token activation scales is not in this check: a
row-parallel rank quantizes its own half of each token, so TP=2 rounds activations
differently from TP=1 by design, as vLLM's does.)
"""

from __future__ import annotations

import torch
from torch import nn

from kvloom.workers.distributed.local_ranks import run_local_ranks
from kvloom.workers.distributed.process_group import RankLayout, single_process_state
from kvloom.workers.layers.linear import QKVParallelLinear, RowParallelLinear
from kvloom.workers.layers.mlp import GatedMLP
from kvloom.workers.layers.moe import FusedMoE, map_expert_weight
from kvloom.workers.layers.quantization import (
    checkpoint_module_names,
    deferred_weights,
    parse_quantization_config,
    quantize_model,
)
from kvloom.workers.layers.quantization.int4_layouts import Int4Reader, int4_keys, qweight_modules
from kvloom.workers.weight_loader import load_weights
from tests.quant_checkpoints import quantization_config, quantize_weight

HIDDEN, HEAD, HEADS, KV_HEADS, INTER, EXPERTS, MOE_INTER = 256, 64, 4, 2, 512, 4, 256
STACKED = [
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]


class Block(nn.Module):
    def __init__(self, tp):
        super().__init__()
        self.tp = tp
        self.attn = nn.Module()
        self.attn.qkv_proj = QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, tp=tp)
        self.attn.o_proj = RowParallelLinear(HEADS * HEAD, HIDDEN, tp=tp)
        self.mlp = GatedMLP(HIDDEN, INTER, tp=tp)
        self.moe = nn.Module()
        self.moe.experts = FusedMoE(EXPERTS, 2, HIDDEN, MOE_INTER, tp=tp)

    map_weight_name = staticmethod(map_expert_weight)

    def forward(self, x, weights, ids):
        q, k, v = self.attn.qkv_proj.split(self.attn.qkv_proj(x))
        out = self.attn.o_proj(q) + self.mlp(x) + self.moe.experts(x, weights, ids)
        gather = self.tp.all_gather
        return out, gather(k.contiguous(), dim=-1), gather(v.contiguous(), dim=-1)


def float_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def w(rows, cols):
        return torch.randn(rows, cols, generator=g) / cols**0.5

    shapes = {
        "attn.q_proj": (HEADS * HEAD, HIDDEN),
        "attn.k_proj": (KV_HEADS * HEAD, HIDDEN),
        "attn.v_proj": (KV_HEADS * HEAD, HIDDEN),
        "attn.o_proj": (HIDDEN, HEADS * HEAD),
        "mlp.gate_proj": (INTER, HIDDEN),
        "mlp.up_proj": (INTER, HIDDEN),
        "mlp.down_proj": (HIDDEN, INTER),
    }
    for e in range(EXPERTS):
        for proj, shape in (("gate_proj", (MOE_INTER, HIDDEN)), ("up_proj", (MOE_INTER, HIDDEN)),
                            ("down_proj", (HIDDEN, MOE_INTER))):  # fmt: skip
            shapes[f"moe.experts.{e}.{proj}"] = shape
    return {f"{name}.weight": w(*shape) for name, shape in shapes.items()}


def quantized_tensors(scheme: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in float_tensors().items():
        parts, _ = quantize_weight(tensor, scheme)
        out.update({name[: -len("weight")] + suffix: t for suffix, t in parts.items()})
    return out


def block_outputs(state, schemes: tuple[str, ...]):
    return [scheme_outputs(state, scheme) for scheme in schemes]


def scheme_outputs(state, scheme: str):
    tensors = quantized_tensors(scheme)
    with deferred_weights():
        block = Block(state.tp)
    qconfig = parse_quantization_config(quantization_config(scheme))
    keys, items = list(tensors.keys()), tensors.items()
    if qconfig.method in ("gptq", "awq"):  # as build_model and checkpoint_weights read them
        qconfig.bind_checkpoint(qweight_modules(keys))
        scheme_ = qconfig.rules[0][1]
        keys = int4_keys(keys, qconfig.method, scheme_.zero_point)
        items = Int4Reader(
            qconfig.method, scheme_.group_size, qconfig.gptq_stored_zero, scheme_.zero_point
        )(items)
    names = checkpoint_module_names(block, keys, STACKED)
    quantize_model(block, qconfig, names, torch.device("cpu"))
    load_weights(block, items, STACKED)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, HIDDEN, generator=g)
    ids = torch.rand(5, EXPERTS, generator=g).argsort(dim=1)[:, :2]
    weights = torch.full((5, 2), 0.5)
    with torch.inference_mode():
        return block(x, weights, ids)


SCHEMES = ("fp8_block", "w4a16_g128", "gptq_g32", "awq_g32")


def test_tensor_parallel_2_matches_one_rank():
    """Every scheme in one pair of rank processes (spawning them is the slow part)."""
    single = block_outputs(single_process_state(), SCHEMES)
    ranks = run_local_ranks(block_outputs, RankLayout(2, 1), SCHEMES, timeout_s=120)
    for rank, per_scheme in enumerate(ranks):
        for scheme, outputs, expected in zip(SCHEMES, per_scheme, single):
            check_rank(scheme, rank, outputs, expected)


def check_rank(scheme, rank, outputs, expected):
    for name, got, want in zip(("out", "k", "v"), outputs, expected):
        assert torch.isfinite(want).all() and got.shape == want.shape
        err = (got - want).abs().max().item()
        scale = want.abs().max().item()
        print(f"ERRNORM {scheme} rank {rank} {name}: {err:.3g} (scale {scale:.3g})")
        assert err <= 1e-5 * max(scale, 1.0), f"{scheme} rank {rank} {name}: {err:.3g}"
