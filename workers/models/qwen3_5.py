"""Qwen3.5 (text): Qwen3-Next's hybrid decoder with Gated DeltaNet layers whose input
projections are separate (in_proj_qkv / _z / _b / _a), and a dense MLP (Qwen3.5) or a
sparse MoE with a gated shared expert (Qwen3.5-MoE) in every layer.

Follows transformers' `modeling_qwen3_5` and `modeling_qwen3_5_moe` (the ForCausalLM text
models and the text half of the ForConditionalGeneration checkpoints). The
rotary embedding there is Qwen3-VL's interleaved multimodal rope: three position streams
(temporal, height, width) share the frequencies by `mrope_section`. For text every stream
holds the same position, so it is exactly 1-D rope over the first `partial_rotary_factor`
of each head, which is what Qwen3NextAttention applies (tests/test_oracle_qwen3_5.py checks
the equality against transformers). Multi-token-prediction (`mtp.*`: the `mtp` drafter
reads them, workers/spec_decode/mtp.py) and vision (`model.visual.*`) weights are
skipped; a checkpoint that nests the decoder under `model.language_model.` (the
multimodal layout) is read by stripping that prefix. Experts
load from per-expert tensors (`experts.<e>.gate_proj.weight`, what transformers writes) or
from the 3-D `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I] tensors some
published Qwen3.5-MoE checkpoints hold. Qwen3.5-MoE's router `mlp.gate` and
`mlp.shared_expert_gate` load into one fused linear as Qwen3-Next's (qwen3_next.py), in
either layout, and its shared expert folds into the fused MoE on the same terms
(`shared_expert_folding`). Its four Gated DeltaNet input projections load as the
four shards of one linear `linear_attn.in_proj` on the same terms as Qwen3-Next's two
(`gdn_fusion`: float checkpoints; quantized ones keep the four linears).
"""

from __future__ import annotations

import torch
from torch import nn

from kvloom.workers.layers.gated_deltanet_split import GatedDeltaNetSplit
from kvloom.workers.layers.mlp import GatedMLP
from kvloom.workers.layers.quantization.config import (
    QuantizationConfig,
    parse_quantization_config,
)
from kvloom.workers.layers.tp_group import LocalGroup, TPGroup
from kvloom.workers.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from kvloom.workers.models.qwen3_next import (
    STACKED_PARAMS,
    Qwen3NextAttention,
    Qwen3NextDecoderLayer,
    Qwen3NextForCausalLM,
    Qwen3NextModel,
    Qwen3NextSparseMoe,
    gate_fusion,
    gdn_fusion,
    layer_types,
    shared_expert_folding,
    zero_centred_norm,
)
from kvloom.workers.weight_loader import resolve_name

MULTIMODAL_PREFIX = "model.language_model."
# Where a checkpoint's decoder layers sit (text and multimodal layouts): the names its
# quantization_config may be written against.
LAYER_PREFIXES = ("model.layers", MULTIMODAL_PREFIX + "layers")


MOE_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)
# 3-D expert tensors -> (per-expert projection names, split of dim 1 into them)
FUSED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def check_text_config(config: dict, moe: bool, name: str) -> None:
    if "hidden_size" not in config and "text_config" in config:
        raise ValueError(
            f"config: {name} needs the text config; this one nests it under text_config "
            "(a multimodal ForConditionalGeneration config: pass its text_config)"
        )
    if not moe and config.get("num_experts"):
        raise ValueError(f"num_experts: {name} is dense, got num_experts={config['num_experts']}")
    if moe:
        for key in MOE_FIELDS:
            value = config.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}: {name} needs a positive integer, got {value!r}")


class Qwen3_5DecoderLayer(Qwen3NextDecoderLayer):
    """Qwen3-Next's layer (same forward and cache layer) with the split-projection Gated
    DeltaNet and a dense MLP or Qwen3-Next's sparse MoE (same router and shared expert)."""

    def __init__(
        self,
        config: dict,
        index: int,
        kind: str,
        tp: TPGroup,
        dtype: torch.dtype,
        qconfig: QuantizationConfig | None = None,
    ):
        # Built here rather than by Qwen3NextDecoderLayer.__init__, which would construct
        # Qwen3-Next's fused-projection token mixer first.
        nn.Module.__init__(self)
        self.kind = kind
        if kind == "linear_attention":
            projections = GatedDeltaNetSplit.checkpoint_projections
            fuse = gdn_fusion(qconfig, index, projections, LAYER_PREFIXES)
            self.linear_attn = GatedDeltaNetSplit(config, index, tp, dtype, fuse)
        else:
            self.self_attn = Qwen3NextAttention(config, index, tp, dtype)
        hidden = config["hidden_size"]
        if config.get("num_experts"):  # Qwen3.5-MoE: every layer is sparse
            fuse = gate_fusion(qconfig, index, LAYER_PREFIXES)
            fold = fuse and shared_expert_folding(config, qconfig, index, LAYER_PREFIXES)
            self.mlp = Qwen3NextSparseMoe(config, tp, dtype, fuse, fold)
        else:
            self.mlp = GatedMLP(
                hidden,
                config["intermediate_size"],
                config.get("hidden_act", "silu"),
                tp=tp,
                dtype=dtype,
            )
        self.input_layernorm = zero_centred_norm(hidden, config, dtype)
        self.post_attention_layernorm = zero_centred_norm(hidden, config, dtype)


class Qwen3_5Model(Qwen3NextModel):
    def __init__(self, config: dict, tp: TPGroup, dtype: torch.dtype):
        nn.Module.__init__(self)  # Qwen3NextModel.__init__ would build Qwen3-Next layers
        self.embed_tokens = VocabParallelEmbedding(
            config["vocab_size"], config["hidden_size"], tp, dtype
        )
        qconfig = parse_quantization_config(config.get("quantization_config"))
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(config, i, kind, tp, dtype, qconfig)
            for i, kind in enumerate(layer_types(config))
        )
        self.norm = zero_centred_norm(config["hidden_size"], config, dtype)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    stacked_params = STACKED_PARAMS
    ignored_weight_prefixes: tuple[str, ...] = ("mtp.", "model.visual.")
    moe = False

    def __init__(self, config: dict, dtype: torch.dtype, tp: TPGroup | None = None):
        nn.Module.__init__(self)  # Qwen3NextForCausalLM.__init__ would build Qwen3NextModel
        check_text_config(config, self.moe, type(self).__name__)
        if self.moe:  # transformers' Qwen3.5-MoE router always renormalises its top-k
            config = {**config, "norm_topk_prob": True}
        tp = tp or LocalGroup()
        self.config = config
        self.model = Qwen3_5Model(config, tp, dtype)
        self.lm_head = ParallelLMHead(config["vocab_size"], config["hidden_size"], tp, dtype)
        self.tied = {"lm_head": "model.embed_tokens"} if config.get("tie_word_embeddings") else {}

    def map_weight_name(self, ckpt_name: str) -> tuple[str, str, int] | None:
        """The multimodal layout's `model.language_model.X` is the text model's `model.X`;
        then Qwen3-Next's rules (experts, a shared expert gate kept separate); every other
        name follows the default rules."""
        if ckpt_name.startswith(MULTIMODAL_PREFIX):
            ckpt_name = "model." + ckpt_name[len(MULTIMODAL_PREFIX) :]
            return super().map_weight_name(ckpt_name) or resolve_name(ckpt_name, STACKED_PARAMS)
        return super().map_weight_name(ckpt_name)

    @staticmethod
    def unpack_weight(ckpt_name: str, tensor: torch.Tensor):
        """`<...>.experts.gate_up_proj` [E, 2I, H] and `<...>.experts.down_proj` [E, H, I]
        as the per-expert tensors they stack (views, no copy); None for any other name."""
        prefix, _, proj = ckpt_name.rpartition(".")
        if not prefix.endswith(".experts") or proj not in FUSED_EXPERTS:
            return None
        parts = FUSED_EXPERTS[proj]
        if tensor.dim() != 3 or tensor.shape[1] % len(parts):
            raise ValueError(
                f"{ckpt_name}: expected a 3-D [experts, rows, cols] tensor with rows divisible "
                f"by {len(parts)}, got shape {tuple(tensor.shape)}"
            )
        return [
            (f"{prefix}.{e}.{part}.weight", chunk)
            for e in range(tensor.shape[0])
            for part, chunk in zip(parts, tensor[e].chunk(len(parts), dim=0), strict=True)
        ]


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE text model: softmax top-k routing (always renormalised) over
    `num_experts`, plus a shared expert scaled by sigmoid(shared_expert_gate(x))."""

    moe = True
