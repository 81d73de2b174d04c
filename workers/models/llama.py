"""Llama-family decoders: Llama, Mistral, Qwen2 (QKV bias) and Qwen3 (per-head q/k norm).

One implementation, switched by config fields, since the four differ only in biases,
q/k normalisation and (Mistral) an optional sliding window.
"""

from __future__ import annotations

import torch
from torch import nn

from kvloom.contracts.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec
from kvloom.workers.attention_metadata import ForwardBatch
from kvloom.workers.layers.attention import PagedAttention
from kvloom.workers.layers.linear import QKVParallelLinear, RowParallelLinear
from kvloom.workers.layers.mlp import GatedMLP
from kvloom.workers.layers.norm import RMSNorm
from kvloom.workers.layers.norm_linear import norm_linear
from kvloom.workers.layers.rotary import RotaryEmbedding, rope_parameters
from kvloom.workers.layers.tp_group import LocalGroup, TPGroup
from kvloom.workers.layers.vocab import ParallelLMHead, VocabParallelEmbedding

STACKED_PARAMS = [
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]


def head_dim_of(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def layer_sliding_window(config: dict, index: int) -> int | None:
    """The window of layer `index`: `layer_types` decides per layer when present."""
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if layer_types is not None:
        return window if layer_types[index] == "sliding_attention" else None
    if config.get("use_sliding_window") is False:
        return None
    return window


class LlamaAttention(nn.Module):
    def __init__(self, config: dict, index: int, tp: TPGroup, dtype: torch.dtype, qk_norm: bool):
        super().__init__()
        hidden = config["hidden_size"]
        self.head_dim = head_dim_of(config)
        bias = bool(config.get("attention_bias", False)) or config["model_type"] == "qwen2"
        self.qkv_proj = QKVParallelLinear(
            hidden,
            self.head_dim,
            config["num_attention_heads"],
            config.get("num_key_value_heads") or config["num_attention_heads"],
            bias=bias,
            tp=tp,
            dtype=dtype,
        )
        self.o_proj = RowParallelLinear(
            config["num_attention_heads"] * self.head_dim,
            hidden,
            bias=bool(config.get("attention_bias", False)),
            tp=tp,
            dtype=dtype,
        )
        eps = config.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, dtype) if qk_norm else None
        rope = rope_parameters(config)
        rotary_dim = int(self.head_dim * rope.get("partial_rotary_factor", 1.0))
        self.rotary = RotaryEmbedding(
            self.head_dim, rotary_dim, config.get("max_position_embeddings", 4096), rope
        )
        self.attn = PagedAttention(
            index,
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5,
            layer_sliding_window(config, index),
        )

    def forward(self, positions, hidden, batch: ForwardBatch):
        return self.attend(positions, self.qkv_proj(hidden), batch)

    def attend(self, positions, qkv, batch: ForwardBatch):
        """forward after the projection: the decoder layer computes `qkv` fused with its
        input norm (norm_linear)."""
        q, k, v = self.qkv_proj.split(qkv)
        q = q.view(q.shape[0], -1, self.head_dim)
        k = k.view(k.shape[0], -1, self.head_dim)
        # Norms, rotary and (at decode on CUDA) this step's cache write in one launch.
        cache = self.attn.cache_write(batch)
        q, k, written = self.rotary.norm_rotate_try_cache(
            positions, q, k, v.view(k.shape), cache, self.q_norm, self.k_norm
        )
        out = self.attn(q.flatten(1), k.flatten(1), v, batch, cache_written=written)
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: dict, index: int, tp: TPGroup, dtype: torch.dtype, qk_norm: bool):
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        self.self_attn = LlamaAttention(config, index, tp, dtype, qk_norm)
        self.mlp = GatedMLP(
            config["hidden_size"],
            config["intermediate_size"],
            config.get("hidden_act", "silu"),
            bias=bool(config.get("mlp_bias", False)),
            tp=tp,
            dtype=dtype,
        )
        self.input_layernorm = RMSNorm(config["hidden_size"], eps, dtype)
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], eps, dtype)

    def forward(self, positions, hidden, residual, batch: ForwardBatch):
        # Each norm and the projection after it: one launch at decode sizes (norm_linear).
        attn, mlp = self.self_attn, self.mlp
        qkv, residual, _ = norm_linear(self.input_layernorm, hidden, residual, attn.qkv_proj)
        hidden = attn.attend(positions, qkv, batch)
        act, residual, _ = norm_linear(
            self.post_attention_layernorm, hidden, residual, mlp.gate_up_proj, silu_and_mul_out=True
        )
        return mlp.down_proj(act), residual


class LlamaModel(nn.Module):
    def __init__(self, config: dict, tp: TPGroup, dtype: torch.dtype, qk_norm: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config["vocab_size"], config["hidden_size"], tp, dtype
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, tp, dtype, qk_norm)
            for i in range(config["num_hidden_layers"])
        )
        self.norm = RMSNorm(config["hidden_size"], config.get("rms_norm_eps", 1e-6), dtype)

    def forward(self, input_ids, positions, batch: ForwardBatch):
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    qk_norm = False
    supports_cuda_graphs = True  # no host sync in a decode-only forward
    stacked_params = STACKED_PARAMS
    ignored_weight_prefixes: tuple[str, ...] = ()

    def __init__(self, config: dict, dtype: torch.dtype, tp: TPGroup | None = None):
        super().__init__()
        tp = tp or LocalGroup()
        self.config = config
        self.model = LlamaModel(config, tp, dtype, self.qk_norm)
        self.lm_head = ParallelLMHead(config["vocab_size"], config["hidden_size"], tp, dtype)
        self.tied = {"lm_head": "model.embed_tokens"} if config.get("tie_word_embeddings") else {}

    def cache_layers(self) -> list[PagedAttention]:
        """Layers that own cache pages (allocate_cache / poison_cache)."""
        return [layer.self_attn.attn for layer in self.model.layers]

    def kv_cache_specs(self, block_size: int, dtype: str) -> dict[int, FullAttentionSpec]:
        """Layer index -> what it caches (sliding-window layers get their own spec)."""
        specs = {}
        for attn in self.cache_layers():
            args = (block_size, attn.num_kv_heads, attn.head_size, dtype)
            specs[attn.layer_index] = (
                SlidingWindowSpec(*args, sliding_window=attn.sliding_window)
                if attn.sliding_window
                else FullAttentionSpec(*args)
            )
        return specs

    def forward(self, input_ids, positions, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
