"""Prometheus metrics text from the engine's stats, for `GET /metrics` on the metrics port
and on the HTTP door (both served by http/).

A dozen gauges and counters and three histograms (cluster/frontend/request_metrics.py)
need no client library: the text exposition format is a line per sample.
"""

from __future__ import annotations

from typing import Any

from kvloom.cluster.frontend.request_metrics import RequestMetrics
from kvloom.cluster.spec_decode.stats import accepted_per_position

# stats key -> (metric name, type, help)
_METRICS = {
    "num_running": ("kvloom_requests_running", "gauge", "Requests being generated."),
    "num_waiting": ("kvloom_requests_waiting", "gauge", "Requests waiting to be scheduled."),
    "num_in_flight": ("kvloom_requests_in_flight", "gauge", "Requests admitted by the server."),
    "kv_cache_usage": ("kvloom_kv_cache_usage_ratio", "gauge", "Fraction of KV blocks in use."),
    "num_blocks": ("kvloom_kv_blocks", "gauge", "KV cache blocks in the pool."),
    "num_free_blocks": ("kvloom_kv_blocks_free", "gauge", "KV cache blocks free or evictable."),
    "num_finished": ("kvloom_requests_finished_total", "counter", "Requests finished."),
    "num_aborted": ("kvloom_requests_aborted_total", "counter", "Requests aborted."),
    "num_preemptions": ("kvloom_preemptions_total", "counter", "Requests preempted."),
    "num_steps": ("kvloom_engine_steps_total", "counter", "Engine steps run."),
    "prefix_cache_queried_tokens": (
        "kvloom_prefix_cache_queried_tokens_total",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
    ),
    "prefix_cache_hit_tokens": (
        "kvloom_prefix_cache_hit_tokens_total",
        "counter",
        "Prompt tokens served from the prefix cache.",
    ),
    "num_evictions": ("kvloom_kv_block_evictions_total", "counter", "Cached blocks evicted."),
}


# The same stats under vLLM's names (labelled model_name, as vLLM's are), so dashboards and
# autoscalers written for vLLM read kvloom too.
_VLLM_METRICS = {
    "num_running": ("vllm:num_requests_running", "gauge", "Requests being generated."),
    "num_waiting": ("vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled."),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "gauge", "KV cache usage, 1 = full."),
    "num_preemptions": ("vllm:num_preemptions_total", "counter", "Requests preempted."),
    "prefix_cache_queried_tokens": (
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
    ),
    "prefix_cache_hit_tokens": (
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prompt tokens served from the prefix cache.",
    ),
    "spec_num_drafts": (
        "vllm:spec_decode_num_drafts_total",
        "counter",
        "Verification steps of a request that had drafts.",
    ),
    "spec_drafted_tokens": (
        "vllm:spec_decode_num_draft_tokens_total",
        "counter",
        "Draft tokens proposed.",
    ),
    "spec_accepted_tokens": (
        "vllm:spec_decode_num_accepted_tokens_total",
        "counter",
        "Draft tokens accepted.",
    ),
}


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(
    stats: dict[str, Any],
    ready: bool,
    model_name: str | None = None,
    request_metrics: RequestMetrics | None = None,
) -> str:
    lines = [
        "# HELP kvloom_ready 1 when the server accepts requests.",
        "# TYPE kvloom_ready gauge",
        f"kvloom_ready {int(ready)}",
    ]
    tables = [(_METRICS, "")]
    if model_name is not None:
        tables.append((_VLLM_METRICS, f'{{model_name="{_label(model_name)}"}}'))
    for table, labels in tables:
        for key, (name, kind, text) in table.items():
            value = stats.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
                lines.append(f"{name}{labels} {value}")
    if model_name is not None:
        lines += _per_position_lines(stats, f'model_name="{_label(model_name)}",')
    lines += _replica_lines(stats.get("replicas") or [])
    if request_metrics is not None and model_name is not None:
        lines += request_metrics.lines(f'{{model_name="{_label(model_name)}"}}')
    return "\n".join(lines) + "\n"


def _per_position_lines(stats: dict[str, Any], labels: str) -> list[str]:
    """vLLM's per-position acceptance counter: drafts whose token j was accepted."""
    counts = accepted_per_position(stats)
    if not counts:
        return []
    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    lines = [f"# HELP {name} Accepted draft tokens by position.", f"# TYPE {name} counter"]
    return lines + [f'{name}{{{labels}position="{j}"}} {n}' for j, n in enumerate(counts)]


# Per data-parallel replica (cluster/replicas.py), labelled replica="i".
_REPLICA_METRICS = {
    "up": ("kvloom_replica_up", "gauge", "1 while the replica is in routing."),
    "in_flight": ("kvloom_replica_requests_in_flight", "gauge", "Requests routed and running."),
    "kv_cache_usage": ("kvloom_replica_kv_cache_usage_ratio", "gauge", "KV blocks in use."),
    "prefix_cache_hit_rate": (
        "kvloom_replica_prefix_cache_hit_rate",
        "gauge",
        "Prompt tokens served from the prefix cache over those looked up.",
    ),
    "routed": ("kvloom_replica_routed_total", "counter", "Requests routed to the replica."),
    "routed_by_prefix": (
        "kvloom_replica_routed_by_prefix_total",
        "counter",
        "Requests routed to the replica for its cached prefix.",
    ),
}


def _replica_lines(replicas: list[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    for key, (name, kind, text) in _REPLICA_METRICS.items():
        samples = [
            f'{name}{{replica="{i}"}} {float(entry[key]):g}'
            for i, entry in enumerate(replicas)
            if isinstance(entry.get(key), int | float)
        ]
        if samples:
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", *samples]
    return lines
