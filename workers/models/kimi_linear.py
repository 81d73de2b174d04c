"""Kimi-Linear (`KimiLinearForCausalLM`): KDA linear attention + NoPE MLA + DeepSeek-V3 MoE.

Layers are KDA (`workers/layers/kda_layer.py`, one state page per request) or MLA
(`workers/layers/mla.py`, a paged latent cache), three KDA layers per MLA layer in the released
models. The MLP is dense for the first `first_k_dense_replace` layers and a sigmoid-routed MoE
with shared experts after; every sublayer is pre-norm with a residual.

config.json uses the checkpoint's own field names (`num_experts_per_token`,
`num_shared_experts`, `num_expert_group`, `moe_renormalize`, `model_max_length`, and a
`linear_attn_config` with 1-based `kda_layers` / `full_attn_layers`); transformers' names are
read too. Layer kinds follow transformers' precedence: `layer_types`, then
`linear_attn_config`, then its default (MLA at every 4th layer after the first).

Checkpoint names are the released ones (what transformers' save_pretrained writes back):
KDA layers fuse `self_attn.{q,k,v,b}_proj` into `qkv_proj`, `{f,g}_a_proj` into `fg_a_proj`
and `{q,k,v}_conv1d` into `conv1d` (`kda_fusions` keeps b_proj or f_a / g_a separate where the
quantization_config gives the parts different schemes); `block_sparse_moe.*` is our `mlp.*`
(dense and MoE alike); experts are `experts.<e>.w1/w2/w3` (gate / down / up). One shared
expert (Kimi-Linear-48B-A3B: `num_shared_experts` 1, so it is as wide as a routed expert,
1024), float like the routed ones, is folded into the fused MoE as expert E
(`shared_experts_folding`): `shared_experts.*` load there and the router appends it to every
token with weight 1 (workers/layers/moe.py).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.contracts.kv_cache_spec import LinearStateSpec, MLASpec
from kvloom.workers.attention_metadata import ForwardBatch
from kvloom.workers.layers.kda_layer import KimiDeltaAttention
from kvloom.workers.layers.linear import check_shape
from kvloom.workers.layers.mla import MultiHeadLatentAttention
from kvloom.workers.layers.mlp import GatedMLP
from kvloom.workers.layers.moe import (
    FusedMoE,
    map_expert_weight,
    map_shared_expert_weight,
    route_grouped_sigmoid_topk,
)
from kvloom.workers.layers.norm import RMSNorm
from kvloom.workers.layers.norm_linear import norm_linear
from kvloom.workers.layers.quantization.config import (
    QuantizationConfig,
    parse_quantization_config,
)
from kvloom.workers.layers.tp_group import LocalGroup, TPGroup
from kvloom.workers.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from kvloom.workers.weight_loader import resolve_name

STACKED_PARAMS = [
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]
# KDA checkpoint modules fused into one kvloom module: name -> (module, shard).
KDA_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "b_proj": ("qkv_proj", 3),
    "f_a_proj": ("fg_a_proj", 0),
    "g_a_proj": ("fg_a_proj", 1),
    "q_conv1d": ("conv1d", 0),
    "k_conv1d": ("conv1d", 1),
    "v_conv1d": ("conv1d", 2),
}
# Any tensor of a projection (a quantized one has weight_packed, weight_scale, ...).
_KDA_FUSED_NAME = re.compile(
    r"^(?P<layer>model\.layers\.(?P<index>\d+)\.self_attn)\."
    r"(?P<part>[qkvb]_proj|[fg]_a_proj|[qkv]_conv1d)\.(?P<param>\w+)$"
)
_MISSING = object()


def read(config: dict, *names: str, default=_MISSING):
    """The first of `names` present (and not null) in config.json, else `default`."""
    for name in names:
        if config.get(name) is not None:
            return config[name]
    if default is _MISSING:
        raise ValueError(f"config.json: missing field {names[0]!r}")
    return default


def layer_types(config: dict) -> list[str]:
    """ "linear_attention" (KDA) or "full_attention" (MLA) per layer."""
    n = config["num_hidden_layers"]
    kinds = ("linear_attention", "full_attention")
    if config.get("layer_types") is not None:
        types = list(config["layer_types"])
        if len(types) != n or any(t not in kinds for t in types):
            raise ValueError(
                f"config.json: layer_types must list {n} entries from {kinds}, got {types}"
            )
        return types
    linear = config.get("linear_attn_config") or {}
    if "kda_layers" in linear and "full_attn_layers" in linear:
        types: list[str | None] = [None] * n
        for field, kind in (("full_attn_layers", kinds[1]), ("kda_layers", kinds[0])):
            for number in linear[field]:
                if not isinstance(number, int) or not 1 <= number <= n:
                    raise ValueError(
                        f"config.json: linear_attn_config.{field} holds 1-based layer numbers "
                        f"in [1, {n}], got {number!r}"
                    )
                types[number - 1] = kind
        if None in types:
            raise ValueError(
                "config.json: linear_attn_config.kda_layers and full_attn_layers leave layer(s) "
                f"{[i + 1 for i, t in enumerate(types) if t is None]} unassigned"
            )
        return types
    return [kinds[1] if i and i % 4 == 0 else kinds[0] for i in range(n)]


def mlp_is_sparse(config: dict) -> list[bool]:
    """Per layer: MoE (True) or dense MLP."""
    n = config["num_hidden_layers"]
    if config.get("mlp_layer_types") is not None:
        types = list(config["mlp_layer_types"])
        if len(types) != n or any(t not in ("dense", "sparse") for t in types):
            raise ValueError(
                f"config.json: mlp_layer_types must list {n} entries of 'dense'/'sparse', "
                f"got {types}"
            )
        return [t == "sparse" for t in types]
    if not read(config, "num_experts", "num_local_experts", "n_routed_experts", default=0):
        return [False] * n
    first_dense = read(config, "first_k_dense_replace", default=1)
    freq = read(config, "moe_layer_freq", default=1)
    return [i >= first_dense and i % freq == 0 for i in range(n)]


def attention_settings(config: dict) -> dict:
    """KDA shape: `linear_attn_config` (checkpoint) over transformers' top-level fields."""
    linear = config.get("linear_attn_config") or {}
    return {
        "num_heads": linear.get("num_heads") or read(config, "linear_num_heads", default=32),
        "head_dim": linear.get("head_dim") or read(config, "linear_head_dim", default=128),
        "conv_kernel_size": linear.get("short_conv_kernel_size")
        or read(config, "linear_conv_kernel_dim", default=4),
    }


def kda_fusions(qconfig: QuantizationConfig | None, index: int) -> dict[str, bool]:
    """Whether KDA layer `index` fuses b_proj into qkv_proj and f_a / g_a into fg_a_proj.
    A fused linear runs one scheme, and checkpoints may leave a small projection (b_proj's
    num_heads rows) float while quantizing q/k/v: parts the quantization_config treats
    differently stay separate modules. The names asked about are the released spelling;
    should a checkpoint's own names get different schemes after all, loading refuses the
    fused layer by name (`QuantizationConfig.scheme_for`), as it refuses q/k/v quantized
    differently (those always fuse: the conv runs over q | k | v)."""
    if qconfig is None:
        return {"fuse_b_proj": True, "fuse_fg_a": True}
    attn = f"model.layers.{index}.self_attn"

    def alike(*parts: str) -> bool:
        return len({qconfig.scheme_for([f"{attn}.{p}"], p) for p in parts}) == 1

    return {
        "fuse_b_proj": alike("q_proj", "k_proj", "v_proj", "b_proj"),
        "fuse_fg_a": alike("f_a_proj", "g_a_proj"),
    }


def shared_experts_folding(config: dict, qconfig: QuantizationConfig | None, index: int) -> bool:
    """Whether MoE layer `index` folds its shared experts into the fused MoE as expert E:
    there is exactly one (moe_intermediate_size x num_shared_experts is then a routed
    expert's width) and the quantization_config leaves it and the routed experts float
    (quantized layers keep the two branches; the FusedMoE's experts share one scheme, so
    expert 0 speaks for them). Asked under the released `block_sparse_moe` spelling and
    kvloom's `mlp`."""
    if read(config, "num_shared_experts", "n_shared_experts", default=1) != 1:
        return False
    if qconfig is None:
        return True
    parts = [f"experts.0.{p}" for p in ("w1", "w2", "w3")]
    parts += [f"shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    names = [
        f"model.layers.{index}.{mlp}.{part}"
        for mlp in ("block_sparse_moe", "mlp")
        for part in parts
    ]
    return all(qconfig.scheme_for([name], name) is None for name in names)


class KimiRouter(nn.Module):
    """DeepSeek-V3 router (checkpoint: `gate.weight`, `gate.e_score_correction_bias`); logits
    and routing in float32 (float64 for float64 models), as transformers computes them.
    `shared_expert_weight="one"` appends a folded shared expert's route (weight 1)."""

    def __init__(
        self,
        config: dict,
        hidden_size: int,
        num_experts: int,
        dtype: torch.dtype,
        shared_expert_weight: str | None = None,
    ):
        super().__init__()
        self.shared_expert_weight = shared_expert_weight
        self.acc = torch.float64 if dtype == torch.float64 else torch.float32
        self.top_k = read(config, "num_experts_per_token", "num_experts_per_tok")
        self.num_groups = read(config, "num_expert_group", "n_group", default=1)
        self.topk_groups = read(config, "topk_group", default=1)
        self.renormalize = bool(read(config, "moe_renormalize", "norm_topk_prob", default=True))
        self.scaling = float(read(config, "routed_scaling_factor", default=2.446))
        activation = config.get("moe_router_activation_func", "sigmoid")
        if activation != "sigmoid":
            raise ValueError(
                f"config.json: moe_router_activation_func {activation!r} is not supported "
                "(Kimi-Linear routes with 'sigmoid')"
            )
        # Held in the routing dtype (an exact upcast at load): the logits are computed
        # there, and a per-step cast would cost a launch and a copy per layer.
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=self.acc), False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=self.acc), False)

    def load_shard(self, param_name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        param = getattr(self, param_name)
        check_shape(param_name, loaded, tuple(param.shape))
        param.data.copy_(loaded)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden.to(self.acc), self.weight)
        return route_grouped_sigmoid_topk(
            logits,
            self.e_score_correction_bias,
            self.top_k,
            self.num_groups,
            self.topk_groups,
            self.renormalize,
            self.scaling,
            self.shared_expert_weight,
        )


class KimiMoE(nn.Module):
    """Routed experts plus shared experts, reduced across ranks once.

    With `fold_shared_experts` (one shared expert; `shared_experts_folding` decides) the
    shared expert is expert E of `experts` and there is no `shared_experts` module: the
    router gives every token k + 1 routes, the last to E with weight 1."""

    def __init__(
        self, config: dict, tp: TPGroup, dtype: torch.dtype, fold_shared_experts: bool = False
    ):
        super().__init__()
        self.tp = tp
        hidden = config["hidden_size"]
        num_experts = read(config, "num_experts", "num_local_experts", "n_routed_experts")
        intermediate = config["moe_intermediate_size"]
        num_shared = read(config, "num_shared_experts", "n_shared_experts", default=1)
        if fold_shared_experts and num_shared != 1:
            raise ValueError(
                f"fold_shared_experts needs exactly one shared expert, got {num_shared}"
            )
        shared_weight = "one" if fold_shared_experts else None
        self.gate = KimiRouter(config, hidden, num_experts, dtype, shared_weight)
        self.experts = FusedMoE(
            num_experts,
            self.gate.top_k,
            hidden,
            intermediate,
            tp=tp,
            dtype=dtype,
            hidden_act=config.get("hidden_act", "silu"),
            reduce_results=False,
            shared_expert=fold_shared_experts,
        )
        self.shared_experts = (
            GatedMLP(
                hidden,
                intermediate * num_shared,
                config.get("hidden_act", "silu"),
                tp=tp,
                dtype=dtype,
                reduce_results=False,
            )
            if num_shared and not fold_shared_experts
            else None
        )

    def forward(
        self,
        hidden: torch.Tensor,
        shared_act: torch.Tensor | None = None,
        router_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`shared_act`: silu(gate) * up of the (unfolded) shared experts on `hidden`,
        computed by the caller (the decoder layer fuses its norm into that GEMV).
        `router_rows`: `hidden` already in the router's dtype (the norm stored it)."""
        weights, ids = self.gate(hidden if router_rows is None else router_rows)
        out = self.experts(hidden, weights, ids)
        if shared_act is not None:
            out = out + self.shared_experts.down_proj(shared_act)
        elif self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return self.tp.all_reduce(out) if self.tp.world_size > 1 else out


class KimiDecoderLayer(nn.Module):
    def __init__(
        self,
        config: dict,
        index: int,
        kind: str,
        sparse: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        qconfig: QuantizationConfig | None = None,
    ):
        super().__init__()
        hidden = config["hidden_size"]
        eps = read(config, "rms_norm_eps", default=1e-5)
        if kind == "linear_attention":
            kda = attention_settings(config)
            self.self_attn = KimiDeltaAttention(
                index,
                hidden,
                kda["num_heads"],
                kda["head_dim"],
                kda["conv_kernel_size"],
                eps,
                activation=config.get("hidden_act", "silu"),
                tp=tp,
                dtype=dtype,
                **kda_fusions(qconfig, index),
            )
        else:
            self.self_attn = MultiHeadLatentAttention(
                index,
                hidden,
                config["num_attention_heads"],
                config["qk_nope_head_dim"],
                config["qk_rope_head_dim"],
                config["v_head_dim"],
                config["kv_lora_rank"],
                config.get("q_lora_rank"),
                bias=bool(config.get("attention_bias", False)),
                tp=tp,
                dtype=dtype,
            )
        self.mlp = (
            KimiMoE(config, tp, dtype, shared_experts_folding(config, qconfig, index))
            if sparse
            else GatedMLP(
                hidden,
                config["intermediate_size"],
                config.get("hidden_act", "silu"),
                tp=tp,
                dtype=dtype,
            )
        )
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)

    def forward(self, hidden, residual, batch: ForwardBatch):
        # Each norm and a projection that reads it: one launch at decode sizes (norm_linear).
        attn = self.self_attn
        # KDA: into qkv_proj (fg_a_proj reads the normed rows the launch stores); MLA: into
        # kv_a_proj_with_mqa, there in both q variants (q_proj / q_a_proj read the rows).
        first = attn.qkv_proj if isinstance(attn, KimiDeltaAttention) else attn.kv_a_proj_with_mqa
        projected, residual, normed = norm_linear(
            self.input_layernorm, hidden, residual, first, keep_normed=True
        )
        hidden = attn(normed, batch, projected=projected)
        post, mlp = self.post_attention_layernorm, self.mlp
        if isinstance(mlp, GatedMLP):
            act, residual, _ = norm_linear(
                post, hidden, residual, mlp.gate_up_proj, silu_and_mul_out=True
            )
            return mlp.down_proj(act), residual
        if mlp.shared_experts is not None:
            # Unfolded shared experts: the norm in their gate_up GEMV; the float32 router
            # and the routed experts read the normed rows it stores.
            act, residual, normed = norm_linear(
                post, hidden, residual, mlp.shared_experts.gate_up_proj,
                silu_and_mul_out=True, keep_normed=True,
            )  # fmt: skip
            return mlp(normed, shared_act=act), residual
        # A folded shared expert: the router's GEMV is float32 (routing precision), which
        # the norm's bf16 prologue does not feed, so the norm stays its own launch; it also
        # stores its rows widened for the router (no cast launch before the router GEMV).
        if mlp.gate.acc == torch.float32 and hidden.dtype in (torch.float16, torch.bfloat16):
            hidden, residual, widened = post.forward_widened(hidden, residual)
            return mlp(hidden, router_rows=widened), residual
        hidden, residual = post(hidden, residual)
        return mlp(hidden), residual


class KimiLinearModel(nn.Module):
    def __init__(self, config: dict, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        hidden = config["hidden_size"]
        self.embed_tokens = VocabParallelEmbedding(config["vocab_size"], hidden, tp, dtype)
        kinds, sparse = layer_types(config), mlp_is_sparse(config)
        qconfig = parse_quantization_config(config.get("quantization_config"))
        self.layers = nn.ModuleList(
            KimiDecoderLayer(config, i, kinds[i], sparse[i], tp, dtype, qconfig)
            for i in range(config["num_hidden_layers"])
        )
        self.norm = RMSNorm(hidden, read(config, "rms_norm_eps", default=1e-5), dtype)

    def forward(self, input_ids, batch: ForwardBatch):
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class KimiLinearForCausalLM(nn.Module):
    # A decode-only forward has no host sync on CUDA: KDA's single-step kernels over all
    # rows, MLA on its own paged kernel (kernels/ops.mla_attention), fused MoE.
    supports_cuda_graphs = True
    stacked_params = STACKED_PARAMS
    ignored_weight_prefixes: tuple[str, ...] = ()

    def __init__(self, config: dict, dtype: torch.dtype, tp: TPGroup | None = None):
        super().__init__()
        if config.get("mla_use_nope") is False:
            raise ValueError(
                "config.json: mla_use_nope=false (rotary MLA) is not supported for "
                "KimiLinearForCausalLM; Kimi-Linear's MLA is NoPE"
            )
        tp = tp or LocalGroup()
        self.config = config
        self.model = KimiLinearModel(config, tp, dtype)
        self.lm_head = ParallelLMHead(config["vocab_size"], config["hidden_size"], tp, dtype)
        self.tied = {"lm_head": "model.embed_tokens"} if config.get("tie_word_embeddings") else {}

    def map_weight_name(self, ckpt_name: str) -> tuple[str, str, int]:
        """Released checkpoint names -> (module path, parameter, shard)."""
        name = ckpt_name.replace(".block_sparse_moe.", ".mlp.")
        name = name.replace(".self_attn.forget_gate.", ".self_attn.")  # transformers' own names
        expert = map_expert_weight(name) or map_shared_expert_weight(self, name, "shared_experts")
        if expert is not None:
            return expert
        match = _KDA_FUSED_NAME.match(name)
        layers = self.model.layers
        if match and int(match["index"]) < len(layers):
            attn = layers[int(match["index"])].self_attn
            # A part the layer keeps as its own module (kda_fusions) loads there.
            if isinstance(attn, KimiDeltaAttention) and getattr(attn, match["part"], None) is None:
                module, shard = KDA_FUSED[match["part"]]
                return f"{match['layer']}.{module}", match["param"], shard
        return resolve_name(name, STACKED_PARAMS)

    def cache_layers(self) -> list[nn.Module]:
        """KDA layers (state pages) and MLA layers (latent cache pages)."""
        return [layer.self_attn for layer in self.model.layers]

    def kv_cache_specs(self, block_size: int, dtype: str) -> dict[int, LinearStateSpec | MLASpec]:
        specs = {}
        for attn in self.cache_layers():
            if isinstance(attn, KimiDeltaAttention):
                specs[attn.layer_index] = LinearStateSpec(
                    block_size,
                    attn.conv_state_shape,
                    attn.recurrent_state_shape,
                    dtype,
                    "float64" if dtype == "float64" else "float32",
                )
            else:
                specs[attn.layer_index] = MLASpec(
                    block_size, attn.kv_lora_rank, attn.qk_rope_head_dim, dtype
                )
        return specs

    def forward(self, input_ids, positions, batch: ForwardBatch) -> torch.Tensor:
        # NoPE throughout: positions only shape the batch metadata (causal masks).
        return self.model(input_ids, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)
