"""Qwen3.5 (text): Qwen3-Next's hybrid decoder with a dense MLP in every layer and Gated
DeltaNet layers whose input projections are separate (in_proj_qkv / _z / _b / _a).

Follows transformers' `modeling_qwen3_5` (Qwen3_5ForCausalLM, Qwen3_5TextConfig). The
rotary embedding there is Qwen3-VL's interleaved multimodal rope: three position streams
(temporal, height, width) share the frequencies by `mrope_section`. For text every stream
holds the same position, so it is exactly 1-D rope over the first `partial_rotary_factor`
of each head, which is what Qwen3NextAttention applies (tests/test_oracle_qwen3_5.py checks
the equality against transformers). Multi-token-prediction (`mtp.*`) and vision
(`model.visual.*`) weights are not used; a checkpoint that nests the decoder under
`model.language_model.` (the multimodal layout) is read by stripping that prefix.
"""

from __future__ import annotations

import torch
from torch import nn

from kvloom.workers.layers.gated_deltanet_split import GatedDeltaNetSplit
from kvloom.workers.layers.mlp import GatedMLP
from kvloom.workers.layers.tp_group import LocalGroup, TPGroup
from kvloom.workers.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from kvloom.workers.models.qwen3_next import (
    STACKED_PARAMS,
    Qwen3NextAttention,
    Qwen3NextDecoderLayer,
    Qwen3NextForCausalLM,
    Qwen3NextModel,
    layer_types,
    zero_centred_norm,
)
from kvloom.workers.weight_loader import resolve_name

MULTIMODAL_PREFIX = "model.language_model."


def check_text_config(config: dict) -> None:
    if "hidden_size" not in config and "text_config" in config:
        raise ValueError(
            "config: Qwen3_5ForCausalLM needs the text config (Qwen3_5TextConfig); this one "
            "nests it under text_config (a multimodal Qwen3_5ForConditionalGeneration config)"
        )
    if config.get("num_experts"):
        raise ValueError(
            f"num_experts: Qwen3_5ForCausalLM is dense, got num_experts={config['num_experts']}"
        )


class Qwen3_5DecoderLayer(Qwen3NextDecoderLayer):
    """Qwen3-Next's layer (same forward and cache layer) with the split-projection Gated
    DeltaNet and a dense MLP."""

    def __init__(self, config: dict, index: int, kind: str, tp: TPGroup, dtype: torch.dtype):
        # Built here rather than by Qwen3NextDecoderLayer.__init__, which would construct
        # Qwen3-Next's fused-projection token mixer first.
        nn.Module.__init__(self)
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNetSplit(config, index, tp, dtype)
        else:
            self.self_attn = Qwen3NextAttention(config, index, tp, dtype)
        hidden = config["hidden_size"]
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
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(config, i, kind, tp, dtype)
            for i, kind in enumerate(layer_types(config))
        )
        self.norm = zero_centred_norm(config["hidden_size"], config, dtype)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    stacked_params = STACKED_PARAMS
    ignored_weight_prefixes: tuple[str, ...] = ("mtp.", "model.visual.")

    def __init__(self, config: dict, dtype: torch.dtype, tp: TPGroup | None = None):
        nn.Module.__init__(self)  # Qwen3NextForCausalLM.__init__ would build Qwen3NextModel
        check_text_config(config)
        tp = tp or LocalGroup()
        self.config = config
        self.model = Qwen3_5Model(config, tp, dtype)
        self.lm_head = ParallelLMHead(config["vocab_size"], config["hidden_size"], tp, dtype)
        self.tied = {"lm_head": "model.embed_tokens"} if config.get("tie_word_embeddings") else {}

    @staticmethod
    def map_weight_name(ckpt_name: str) -> tuple[str, str, int] | None:
        """The multimodal layout's `model.language_model.X` is the text model's `model.X`;
        every other name follows the default rules."""
        if ckpt_name.startswith(MULTIMODAL_PREFIX):
            return resolve_name("model." + ckpt_name[len(MULTIMODAL_PREFIX) :], STACKED_PARAMS)
        return None
