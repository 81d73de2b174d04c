"""The offline workload's physical floor: the fewest seconds any engine could serve it in.

`kvloom bench throughput` times a fixed set of requests (prompt length p, output length o).
Whatever the schedule, serving them takes at least

  * the matmuls: 2 x (the layers' weights) x (tokens through the model, p + o - 1 each) and
    2 x (the LM head) x (rows sampled, o each), at the measured matmul rate;
  * prefill attention: 4 x heads x head size per (query, key) pair of each prompt (causal,
    keys capped at a sliding window), at the same rate;
  * decode attention: every decode step of a request reads its whole KV cache (p + s keys
    at step s, capped at the window), at the measured copy rate.

Summed, they are a lower bound (it ignores everything else: weights streamed in small
steps, norms, sampling, the host) that needs no schedule, so an engine's seconds against
it say how much room is left, and two engines' ratio cannot exceed floor / slower engine.
Defined for models whose every layer is paged attention without mixture of experts (dense
Llama / Qwen / Mistral shapes); other models get a reason instead of a floor.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttentionLayer:
    """One layer's attention, as rank 0 computes it (its shard's heads at TP > 1)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    sliding_window: int | None = None


@dataclasses.dataclass(frozen=True)
class FloorModel:
    """What the floor needs of a model: its matmul weights and its attention layers."""

    body_params: int  # weights every token multiplies (embedding lookup and LM head apart)
    lm_head_params: int
    layers: tuple[AttentionLayer, ...]
    kv_bytes_per_element: int


def keys_sum(first: int, last: int, window: int | None) -> int:
    """Sum over positions j = first..last of the keys position j attends: j, or at most
    `window`."""
    if last < first:
        return 0
    if window is None or last <= window:
        return (first + last) * (last - first + 1) // 2
    capped_from = max(first, window + 1)
    below = keys_sum(first, capped_from - 1, None) if capped_from > first else 0
    return below + window * (last - capped_from + 1)


def workload_counts(model: FloorModel, requests: list[tuple[int, int]]) -> dict:
    """FLOPs and bytes of `requests` ((prompt length, output length) each): the matmuls,
    prefill attention's FLOPs and decode attention's KV bytes."""
    tokens = sum(p + o - 1 for p, o in requests)
    sampled = sum(o for _, o in requests)
    prefill_flops = decode_bytes = 0
    for layer in model.layers:
        window = layer.sliding_window
        pairs = sum(keys_sum(1, p, window) for p, _ in requests)
        prefill_flops += 4 * layer.num_heads * layer.head_size * pairs
        # Decode step s (1 .. o - 1) feeds the token at position p + s.
        keys = sum(keys_sum(p + 1, p + o - 1, window) for p, o in requests)
        decode_bytes += keys * 2 * layer.num_kv_heads * layer.head_size
    return {
        "matmul_flops": 2 * model.body_params * tokens + 2 * model.lm_head_params * sampled,
        "prefill_attention_flops": prefill_flops,
        "decode_kv_bytes": decode_bytes * model.kv_bytes_per_element,
    }


def offline_floor(
    model: FloorModel,
    requests: list[tuple[int, int]],
    matmul_flops_per_s: float,
    copy_bytes_per_s: float,
) -> dict:
    """The floor's parts and total in seconds, with the counts and rates behind them."""
    counts = workload_counts(model, requests)
    compute_s = (counts["matmul_flops"] + counts["prefill_attention_flops"]) / matmul_flops_per_s
    decode_s = counts["decode_kv_bytes"] / copy_bytes_per_s
    return {
        **counts,
        "matmul_TFLOPs": round(matmul_flops_per_s / 1e12, 1),
        "floor_compute_seconds": round(compute_s, 4),
        "floor_decode_attention_seconds": round(decode_s, 4),
        "floor_seconds": round(compute_s + decode_s, 4),
    }


def floor_model(model, kv_cache_dtype: str) -> FloorModel | str:
    """`model`'s FloorModel, or why it has none (this runs where the weights are: rank 0's
    worker). The KV cache holds the weights' dtype unless `kv_cache_dtype` is fp8."""
    from kvloom.workers.layers.attention import PagedAttention

    if any(hasattr(module, "w13") for module in model.modules()):
        return "mixture of experts (tokens read only their experts' weights)"
    attention = [m for m in model.modules() if isinstance(m, PagedAttention)]
    decoder = getattr(getattr(model, "model", None), "layers", None)
    if decoder is None or len(attention) != len(decoder):
        return "layers other than paged attention (linear attention, MLA)"
    lm_head = getattr(model, "lm_head", None)
    lm_head_params = lm_head.weight.numel() if lm_head is not None else 0
    body = sum(
        p.numel()
        for name, p in model.named_parameters()
        if p.dim() >= 2 and "embed_tokens" not in name and not name.startswith("lm_head")
    )
    layers = tuple(
        AttentionLayer(m.num_heads, m.num_kv_heads, m.head_size, m.sliding_window)
        for m in attention
    )
    kv_bytes = 1 if kv_cache_dtype == "fp8" else next(model.parameters()).element_size()
    return FloorModel(body, lm_head_params, layers, kv_bytes)
