"""Qwen3-Next: a hybrid decoder of Gated DeltaNet and gated full-attention layers, with
sparse MoE (softmax top-k + a sigmoid-gated shared expert) or dense MLPs.

Follows transformers' `modeling_qwen3_next`: every RMSNorm of the decoder is zero-centred
((1 + w) scaling), except the gated norm inside Gated DeltaNet; full attention projects a
query and an output gate per head (q_proj's rows interleave them head by head), normalises
q/k per head and rotates only the first `partial_rotary_factor` of each head.
Multi-token-prediction weights (`mtp.*`) are skipped here; the `mtp` drafter
(workers/spec_decode/mtp.py) reads them.

Checkpoint names are the released ones. A sparse MoE layer's router `mlp.gate` [E, H] and
`mlp.shared_expert_gate` [1, H] both read x, and a batch-1 decode step is bound by launches,
not bytes: they load as the two shards of one replicated linear `mlp.gate` [E + 1, H] (one
GEMM), unless the quantization_config gives them different schemes (`gate_fusion`). Where
the shared expert is as wide as a routed one and neither is quantized (Qwen3-Next-80B:
512 and 512), it is folded into the fused MoE as expert E (`shared_expert_folding`): its
`mlp.shared_expert.*` tensors load into `mlp.experts` and the router appends it to every
token with weight sigmoid(the gate GEMM's last column) (workers/layers/moe.py).
A Gated DeltaNet layer's `in_proj_qkvz` and `in_proj_ba` load as the two shards of one
linear `linear_attn.in_proj` (regrouped to [q | k | v | z | b,a]: one GEMM, no cat) where
the quantization_config leaves both float (`gdn_fusion`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from kvloom.contracts.kv_cache_spec import FullAttentionSpec, LinearStateSpec
from kvloom.kernels.ops import gated_add, mul_sigmoid
from kvloom.workers.attention_metadata import ForwardBatch
from kvloom.workers.layers.attention import PagedAttention
from kvloom.workers.layers.gated_deltanet import GatedDeltaNet
from kvloom.workers.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from kvloom.workers.layers.mlp import GatedMLP
from kvloom.workers.layers.moe import (
    FusedMoE,
    map_expert_weight,
    map_shared_expert_weight,
    route_softmax_topk,
)
from kvloom.workers.layers.norm import RMSNorm
from kvloom.workers.layers.norm_linear import norm_linear, norm_linear_route
from kvloom.workers.layers.quantization.config import (
    QuantizationConfig,
    parse_quantization_config,
)
from kvloom.workers.layers.rotary import RotaryEmbedding, rope_parameters
from kvloom.workers.layers.tp_group import LocalGroup, TPGroup
from kvloom.workers.layers.vocab import ParallelLMHead, VocabParallelEmbedding

STACKED_PARAMS = [
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
    # The shared expert's gate is the last row of the MoE's fused `gate` (gate_fusion); the
    # model maps it to a module of its own where a layer keeps the two separate.
    ("gate", "shared_expert_gate", 1),
]
LAYER_TYPES = ("linear_attention", "full_attention")
# Any tensor of a shared expert gate (a quantized one has weight_packed, weight_scale, ...).
_SHARED_GATE_NAME = re.compile(
    r"^(?P<mlp>model\.layers\.(?P<index>\d+)\.mlp)\.shared_expert_gate\.(?P<param>\w+)$"
)


# Any tensor of a Gated DeltaNet input projection (fused into `in_proj`: gdn_fusion).
_GDN_PROJ_NAME = re.compile(
    r"^(?P<attn>model\.layers\.(?P<index>\d+)\.linear_attn)\.(?P<proj>in_proj_\w+)\.(?P<param>\w+)$"
)


def zero_centred_norm(size: int, config: dict, dtype: torch.dtype) -> RMSNorm:
    return RMSNorm(size, config.get("rms_norm_eps", 1e-6), dtype, weight_offset=1.0)


def layer_types(config: dict) -> list[str]:
    """Per-layer token mixer; transformers' default is full attention every
    `full_attention_interval` (4) layers."""
    n = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types is None:
        interval = config.get("full_attention_interval", 4)
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)
        ]
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} num_hidden_layers")
    for t in types:
        if t not in LAYER_TYPES:
            raise ValueError(f"layer_types: {t!r} is not one of {LAYER_TYPES}")
    return list(types)


def is_sparse_layer(config: dict, index: int) -> bool:
    """transformers' rule: MoE unless listed in mlp_only_layers, off the sparse step, or
    the model has no experts."""
    return (
        index not in (config.get("mlp_only_layers") or [])
        and config.get("num_experts", 0) > 0
        and (index + 1) % config.get("decoder_sparse_step", 1) == 0
    )


def gate_fusion(
    qconfig: QuantizationConfig | None, index: int, layers: tuple[str, ...] = ("model.layers",)
) -> bool:
    """Whether MoE layer `index` fuses its router `gate` and `shared_expert_gate` into one
    linear. A fused linear runs one scheme; published FP8 checkpoints leave both float, and
    a config that quantizes one and not the other keeps them separate modules. Asked by the
    checkpoint's module names under each of `layers` (the prefixes its decoder may sit
    under): fused only where every spelling gives both the same scheme. Should the
    checkpoint's own names get different schemes after all, loading refuses the fused layer
    by name (`QuantizationConfig.scheme_for`)."""
    if qconfig is None:
        return True
    mlps = [f"{prefix}.{index}.mlp" for prefix in layers]
    return all(
        qconfig.scheme_for([f"{mlp}.gate"], "gate")
        == qconfig.scheme_for([f"{mlp}.shared_expert_gate"], "shared_expert_gate")
        for mlp in mlps
    )


def gdn_fusion(
    qconfig: QuantizationConfig | None,
    index: int,
    projections: tuple[str, ...],
    layers: tuple[str, ...] = ("model.layers",),
) -> bool:
    """Whether Gated DeltaNet layer `index` loads its checkpoint `projections` into one
    float linear (GatedDeltaNet's `in_proj`): the quantization_config leaves every one of
    them float under each spelling in `layers`. A quantized checkpoint keeps the released
    linears (regrouping rows of quantized weights and their block scales is not done)."""
    if qconfig is None:
        return True
    names = [f"{prefix}.{index}.linear_attn.{proj}" for prefix in layers for proj in projections]
    return all(qconfig.scheme_for([name], name) is None for name in names)


def shared_expert_folding(
    config: dict,
    qconfig: QuantizationConfig | None,
    index: int,
    layers: tuple[str, ...] = ("model.layers",),
) -> bool:
    """Whether MoE layer `index` folds its shared expert into the fused MoE as expert E:
    the shared expert is as wide as a routed one, and the quantization_config leaves both
    float under every checkpoint spelling in `layers` (quantized layers keep the two
    branches; the FusedMoE's experts share one scheme, so expert 0 speaks for them all).
    The caller also needs the gates fused (`gate_fusion`): the shared gate's logit is read
    from the fused router GEMM."""
    if config["shared_expert_intermediate_size"] != config["moe_intermediate_size"]:
        return False
    if qconfig is None:
        return True
    parts = [f"experts.0.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    parts += [f"shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    names = [f"{prefix}.{index}.mlp.{part}" for prefix in layers for part in parts]
    return all(qconfig.scheme_for([name], name) is None for name in names)


class Qwen3NextAttention(nn.Module):
    """Full attention with a per-head sigmoid output gate and partial rotary."""

    def __init__(self, config: dict, index: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        hidden = config["hidden_size"]
        num_heads = config["num_attention_heads"]
        num_kv_heads = config.get("num_key_value_heads") or num_heads
        self.head_dim = config.get("head_dim") or hidden // num_heads
        if num_heads % tp.world_size:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be divisible by "
                f"tensor_parallel_size ({tp.world_size})"
            )
        bias = bool(config.get("attention_bias", False))
        # q_proj's rows are [q_h | gate_h] per head: as 2 * num_heads "heads" of head_dim,
        # each rank's contiguous slice holds whole (query, gate) pairs.
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, 2 * num_heads, num_kv_heads, bias=bias, tp=tp, dtype=dtype
        )
        self.num_heads = num_heads // tp.world_size
        self.o_proj = RowParallelLinear(
            num_heads * self.head_dim, hidden, bias=bias, tp=tp, dtype=dtype
        )
        self.q_norm = zero_centred_norm(self.head_dim, config, dtype)
        self.k_norm = zero_centred_norm(self.head_dim, config, dtype)
        rope = rope_parameters(config)
        factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        self.rotary = RotaryEmbedding(
            self.head_dim,
            int(self.head_dim * factor),
            config.get("max_position_embeddings", 4096),
            rope,
        )
        self.attn = PagedAttention(
            index, self.num_heads, self.qkv_proj.num_kv_heads, self.head_dim, self.head_dim**-0.5
        )

    def forward(self, positions, hidden, batch: ForwardBatch):
        return self.attend(positions, self.qkv_proj(hidden), batch)

    def attend(self, positions, qkv, batch: ForwardBatch):
        """forward after the projection: the decoder layer computes `qkv` fused with its
        input norm (norm_linear)."""
        tokens = qkv.shape[0]
        q_gate, k, v = self.qkv_proj.split(qkv)
        q_gate = q_gate.view(tokens, self.num_heads, 2 * self.head_dim)
        q, gate = q_gate.split(self.head_dim, dim=-1)
        k = k.view(tokens, -1, self.head_dim)
        # Norms, rotary and (at decode on CUDA) this step's cache write in one launch.
        cache = self.attn.cache_write(batch)
        q, k, written = self.rotary.norm_rotate_try_cache(
            positions, q, k, v.view(k.shape), cache, self.q_norm, self.k_norm
        )
        out = self.attn(q.flatten(1), k.flatten(1), v, batch, cache_written=written)
        # out * sigmoid(gate), the gate read in place: one launch at decode on CUDA.
        return self.o_proj(mul_sigmoid(out, gate))


class Qwen3NextSparseMoe(nn.Module):
    """Routed experts plus a shared expert scaled by sigmoid(shared_expert_gate(x)).

    With `fuse_gates`, `gate` is one linear [E + 1, H] giving the router's E logits and then
    the shared expert's gate logit, read as views of its output; else `gate` [E, H] and
    `shared_expert_gate` [1, H] are separate (gate_fusion). Both are whole on every rank
    (tensor parallelism splits the experts and the shared expert only).

    With `fold_shared_expert` (needs `fuse_gates` and equal expert widths;
    `shared_expert_folding` decides) the shared expert is expert E of `experts` and there is
    no `shared_expert` module: the router gives every token k + 1 routes, the last to E
    weighted sigmoid(gate logit), and the fused MoE computes both branches in one pass.
    Without it, the two branches run apart and are joined by `gated_add`."""

    def __init__(
        self,
        config: dict,
        tp: TPGroup,
        dtype: torch.dtype,
        fuse_gates: bool = True,
        fold_shared_expert: bool = False,
    ):
        super().__init__()
        hidden, num_experts = config["hidden_size"], config["num_experts"]
        self.tp = tp
        self.num_experts = num_experts
        self.top_k = config["num_experts_per_tok"]
        self.renormalize = bool(config.get("norm_topk_prob", True))
        self.fused_gates = fuse_gates
        self.folded_shared_expert = fold_shared_expert
        inter = config["moe_intermediate_size"]
        shared_inter = config["shared_expert_intermediate_size"]
        if fold_shared_expert and (not fuse_gates or shared_inter != inter):
            raise ValueError(
                "fold_shared_expert needs fused gates and shared_expert_intermediate_size "
                f"({shared_inter}) equal to moe_intermediate_size ({inter})"
            )
        act = config.get("hidden_act", "silu")
        if fuse_gates:  # a one-rank group makes the fused linear replicated
            self.gate = ColumnParallelLinear(hidden, [num_experts, 1], tp=LocalGroup(), dtype=dtype)
        else:
            self.gate = ReplicatedLinear(hidden, num_experts, dtype=dtype)
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, dtype=dtype)
        self.experts = FusedMoE(
            num_experts,
            self.top_k,
            hidden,
            inter,
            tp=tp,
            dtype=dtype,
            hidden_act=act,
            reduce_results=False,
            shared_expert=fold_shared_expert,
        )
        if not fold_shared_expert:
            self.shared_expert = GatedMLP(
                hidden, shared_inter, act, tp=tp, dtype=dtype, reduce_results=False
            )

    @property
    def shared_expert_gate(self) -> nn.Module:
        """The linear giving the shared expert's gate logit: its own module where the gates
        are kept separate (registered under this name), else the fused `gate`."""
        return self._modules.get("shared_expert_gate", self.gate)

    @property
    def router_args(self) -> dict:
        """The folded layer's router arguments (route_softmax_topk's, norm_linear_route's)."""
        return dict(
            top_k=self.top_k,
            renormalize=self.renormalize,
            shared_expert_weight="sigmoid_last_logit",
        )

    def forward(
        self,
        x: torch.Tensor,
        logits: torch.Tensor | None = None,
        routes: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`logits`: self.gate(x), computed by the caller (the decoder layer fuses it with
        its norm); `routes`: the folded layer's (weights, ids) where the caller's GEMV
        launch also routed (norm_linear_route)."""
        if logits is None:
            logits = self.gate(x)
        # Both branches end in a row-parallel projection; their partial sums are reduced
        # once (the shared gate is a per-token scalar, so it commutes with the sum).
        if self.folded_shared_expert:
            out = self._folded(x, logits, routes)
        else:
            out = self._two_branches(x, logits)
        return self.tp.all_reduce(out) if self.tp.world_size > 1 else out

    def _folded(self, x: torch.Tensor, logits: torch.Tensor, routes) -> torch.Tensor:
        """Router GEMM (given), router (k + 1 routes; given where it ran in the GEMM's
        launch), fused MoE: three steps."""
        # logits [T, E + 1]: the router's logits, then the shared gate's
        if routes is None:
            routes = route_softmax_topk(logits, **self.router_args)
        return self.experts(x, *routes)

    def _two_branches(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(x)
        # logits: self.gate(x), in x's dtype, as transformers' router computes them
        if self.fused_gates:  # strided views, which the router and gated_add read
            logits, shared_gate = logits.split([self.num_experts, 1], dim=-1)
        else:
            shared_gate = self.shared_expert_gate(x)
        weights, ids = route_softmax_topk(logits, self.top_k, self.renormalize)
        routed = self.experts(x, weights, ids)
        return gated_add(routed, shared_gate, shared)  # one launch on CUDA


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(
        self,
        config: dict,
        index: int,
        kind: str,
        tp: TPGroup,
        dtype: torch.dtype,
        qconfig: QuantizationConfig | None = None,
    ):
        super().__init__()
        self.kind = kind
        if kind == "linear_attention":
            fuse = gdn_fusion(qconfig, index, GatedDeltaNet.checkpoint_projections)
            self.linear_attn = GatedDeltaNet(config, index, tp, dtype, fuse)
        else:
            self.self_attn = Qwen3NextAttention(config, index, tp, dtype)
        if is_sparse_layer(config, index):
            fuse = gate_fusion(qconfig, index)
            fold = fuse and shared_expert_folding(config, qconfig, index)
            self.mlp = Qwen3NextSparseMoe(config, tp, dtype, fuse, fold)
        else:
            self.mlp = GatedMLP(
                config["hidden_size"],
                config["intermediate_size"],
                config.get("hidden_act", "silu"),
                tp=tp,
                dtype=dtype,
            )
        self.input_layernorm = zero_centred_norm(config["hidden_size"], config, dtype)
        self.post_attention_layernorm = zero_centred_norm(config["hidden_size"], config, dtype)

    @property
    def cache_layer(self):
        return self.linear_attn if self.kind == "linear_attention" else self.self_attn.attn

    def forward(self, positions, hidden, residual, batch: ForwardBatch):
        # Each norm and the projection after it: one launch at decode sizes (norm_linear).
        norm = self.input_layernorm
        if self.kind != "linear_attention":
            attn = self.self_attn
            qkv, residual, _ = norm_linear(norm, hidden, residual, attn.qkv_proj)
            hidden = attn.attend(positions, qkv, batch)
        elif self.linear_attn.fused:
            gdn = self.linear_attn
            # The norm, in_proj and (decode-only) the conv update: one launch at decode.
            projected, residual, convolved = gdn.norm_project(norm, hidden, residual, batch)
            hidden = gdn(hidden, batch, projected=projected, convolved=convolved)
        else:  # the unfused GDN projections (a quantized checkpoint): norm, two linears
            if residual is None:
                residual, hidden = hidden, norm(hidden)
            else:
                hidden, residual = norm(hidden, residual)
            hidden = self.linear_attn(hidden, batch)
        post, mlp = self.post_attention_layernorm, self.mlp
        if isinstance(mlp, GatedMLP):
            act, residual, _ = norm_linear(
                post, hidden, residual, mlp.gate_up_proj, silu_and_mul_out=True
            )
            return mlp.down_proj(act), residual
        # The router's GEMV with the norm (and the router itself where it fuses: a folded
        # shared expert's routes); the experts read the normed rows it stores.
        if mlp.folded_shared_expert:
            logits, residual, normed, routes = norm_linear_route(
                post, hidden, residual, mlp.gate, **mlp.router_args
            )
            return mlp(normed, logits, routes), residual
        logits, residual, normed = norm_linear(post, hidden, residual, mlp.gate, keep_normed=True)
        return mlp(normed, logits), residual


class Qwen3NextModel(nn.Module):
    def __init__(self, config: dict, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config["vocab_size"], config["hidden_size"], tp, dtype
        )
        qconfig = parse_quantization_config(config.get("quantization_config"))
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(config, i, kind, tp, dtype, qconfig)
            for i, kind in enumerate(layer_types(config))
        )
        self.norm = zero_centred_norm(config["hidden_size"], config, dtype)

    def forward(self, input_ids, positions, batch: ForwardBatch):
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3NextForCausalLM(nn.Module):
    # A decode-only forward has no host sync on CUDA: the GDN decode path, the Triton
    # fused MoE and the paged attention kernel all keep lengths on the device.
    supports_cuda_graphs = True
    stacked_params = STACKED_PARAMS
    ignored_weight_prefixes: tuple[str, ...] = ("mtp.",)

    def __init__(self, config: dict, dtype: torch.dtype, tp: TPGroup | None = None):
        super().__init__()
        tp = tp or LocalGroup()
        self.config = config
        self.model = Qwen3NextModel(config, tp, dtype)
        self.lm_head = ParallelLMHead(config["vocab_size"], config["hidden_size"], tp, dtype)
        self.tied = {"lm_head": "model.embed_tokens"} if config.get("tie_word_embeddings") else {}

    def map_weight_name(self, ckpt_name: str) -> tuple[str, str, int] | None:
        """Per-expert checkpoint tensors go into the stacked FusedMoE weights, and so do a
        folded shared expert's (as expert E); a shared expert gate a layer keeps separate
        (gate_fusion) loads into its own module. None: the default rules (STACKED_PARAMS,
        which fuse the shared expert gate into `gate`). A fused Gated DeltaNet layer's
        released input projections load as the shards of its `in_proj`."""
        expert = map_expert_weight(ckpt_name) or map_shared_expert_weight(
            self, ckpt_name, "shared_expert"
        )
        if expert is not None:
            return expert
        layers = self.model.layers
        match = _GDN_PROJ_NAME.match(ckpt_name)
        if match and int(match["index"]) < len(layers):
            attn = getattr(layers[int(match["index"])], "linear_attn", None)
            sources = getattr(attn, "checkpoint_projections", ())
            if attn is not None and attn.fused and match["proj"] in sources:
                return f"{match['attn']}.in_proj", match["param"], sources.index(match["proj"])
        match = _SHARED_GATE_NAME.match(ckpt_name)
        if match and int(match["index"]) < len(layers):
            mlp = layers[int(match["index"])].mlp
            if isinstance(mlp, Qwen3NextSparseMoe) and not mlp.fused_gates:
                return f"{match['mlp']}.shared_expert_gate", match["param"], 0
        return None

    def cache_layers(self) -> list[nn.Module]:
        """Attention layers (KV pages) and Gated DeltaNet layers (state pages)."""
        return [layer.cache_layer for layer in self.model.layers]

    def kv_cache_specs(
        self, block_size: int, dtype_name: str
    ) -> dict[int, FullAttentionSpec | LinearStateSpec]:
        specs = {}
        for layer in self.cache_layers():
            if isinstance(layer, GatedDeltaNet):
                specs[layer.layer_index] = layer.state_spec(block_size, dtype_name)
            else:
                specs[layer.layer_index] = FullAttentionSpec(
                    block_size, layer.num_kv_heads, layer.head_size, dtype_name
                )
        return specs

    def forward(self, input_ids, positions, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)
