"""cluster/offline_floor.py: the offline workload's floor, against brute-force counts."""

import random

import pytest
import torch
from torch import nn

from kvloom.cluster.offline_floor import (
    AttentionLayer,
    FloorModel,
    floor_model,
    keys_sum,
    offline_floor,
    workload_counts,
)
from kvloom.workers.layers.attention import PagedAttention


@pytest.mark.parametrize("window", [None, 1, 3, 7, 50])
def test_keys_sum_is_the_sum_of_capped_positions(window):
    for first in range(1, 12):
        for last in range(first - 2, 20):
            brute = sum(j if window is None else min(j, window) for j in range(first, last + 1))
            assert keys_sum(first, last, window) == brute, (first, last, window)


def test_counts_of_one_request_by_hand():
    # One layer: 2 query heads, 1 KV head of size 4. Prompt 3, output 2: the model runs
    # tokens 1..3 (prefill) and token 4 (one decode step, attending 4 keys).
    model = FloorModel(10, 5, (AttentionLayer(2, 1, 4),), kv_bytes_per_element=2)
    counts = workload_counts(model, [(3, 2)])
    assert counts["matmul_flops"] == 2 * 10 * 4 + 2 * 5 * 2
    assert counts["prefill_attention_flops"] == 4 * 2 * 4 * (1 + 2 + 3)
    assert counts["decode_kv_bytes"] == 4 * (2 * 1 * 4) * 2


def brute_counts(model: FloorModel, requests):
    """Step by step, as an engine would run the requests one token at a time."""
    matmul = prefill = decode = 0
    for prompt, out in requests:
        matmul += 2 * model.lm_head_params * out
        for position in range(1, prompt + out):  # the last sampled token is never fed
            matmul += 2 * model.body_params
            for layer in model.layers:
                keys = (
                    position
                    if layer.sliding_window is None
                    else min(position, layer.sliding_window)
                )
                if position <= prompt:
                    prefill += 4 * layer.num_heads * layer.head_size * keys
                else:
                    decode += keys * 2 * layer.num_kv_heads * layer.head_size
    return matmul, prefill, decode * model.kv_bytes_per_element


def test_counts_match_a_token_by_token_count():
    rng = random.Random(0)
    layers = (AttentionLayer(8, 2, 16), AttentionLayer(8, 2, 16, sliding_window=12))
    model = FloorModel(1000, 300, layers, kv_bytes_per_element=1)
    requests = [(rng.randint(1, 40), rng.randint(1, 30)) for _ in range(25)]
    counts = workload_counts(model, requests)
    assert (
        counts["matmul_flops"],
        counts["prefill_attention_flops"],
        counts["decode_kv_bytes"],
    ) == brute_counts(model, requests)


def test_floor_is_compute_at_the_matmul_rate_plus_kv_reads_at_the_copy_rate():
    model = FloorModel(10**6, 10**5, (AttentionLayer(4, 2, 8),), kv_bytes_per_element=2)
    requests = [(100, 50), (20, 200)]
    counts = workload_counts(model, requests)
    floor = offline_floor(model, requests, matmul_flops_per_s=1e9, copy_bytes_per_s=1e8)
    compute = (counts["matmul_flops"] + counts["prefill_attention_flops"]) / 1e9
    assert floor["floor_compute_seconds"] == round(compute, 4)
    assert floor["floor_decode_attention_seconds"] == round(counts["decode_kv_bytes"] / 1e8, 4)
    assert floor["floor_seconds"] == round(compute + counts["decode_kv_bytes"] / 1e8, 4)
    assert floor["matmul_TFLOPs"] == 0.0


class _Layer(nn.Module):
    def __init__(self, index, window=None):
        super().__init__()
        self.qkv = nn.Linear(16, 48, bias=True)
        self.norm = nn.LayerNorm(16)
        self.attn = PagedAttention(index, 4, 2, 4, 0.5, sliding_window=window)


class _Decoder(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(64, 16)
        self.layers = nn.ModuleList(layers)


class _Model(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.model = _Decoder(layers)
        self.lm_head = nn.Linear(16, 64, bias=False)


def test_floor_model_counts_matrices_but_not_the_embedding_or_vectors():
    model = _Model([_Layer(0), _Layer(1, window=8)]).to(torch.bfloat16)
    found = floor_model(model, "auto")
    assert found == FloorModel(
        body_params=2 * 16 * 48,
        lm_head_params=16 * 64,
        layers=(AttentionLayer(4, 2, 4), AttentionLayer(4, 2, 4, 8)),
        kv_bytes_per_element=2,
    )
    assert floor_model(model, "fp8").kv_bytes_per_element == 1


def test_floor_model_names_what_it_cannot_bound():
    moe = _Model([_Layer(0)])
    moe.model.layers[0].w13 = nn.Parameter(torch.zeros(2, 4, 4))
    assert "mixture of experts" in floor_model(moe, "auto")
    hybrid = _Model([_Layer(0)])
    hybrid.model.layers.append(nn.Linear(16, 16))  # a layer without paged attention
    assert "other than paged attention" in floor_model(hybrid, "auto")
