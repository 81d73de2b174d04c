"""Latency histograms and token counters of finished requests, for `/metrics`.

The front door observes each request once, when its final output is delivered: time to
first token and time per output token as the engine measured them (from the request's
arrival), end-to-end latency as the front door saw it (admission to the final output),
and prompt and generation tokens. Names, types and buckets follow vLLM's, so dashboards
written for vLLM read kvloom.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# Tokens per verification step of one request: 1 (no draft accepted) to 1 + k (k <= 16).
SPEC_LENGTH_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 17.0)


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)  # the last: above every bucket

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, labels: str) -> list[str]:
        """Prometheus text: cumulative `_bucket` samples, `_sum`, `_count`."""
        inner = labels[1:-1] + "," if labels else ""
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            cumulative += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{self.name}_bucket{{{inner}le="{le}"}} {cumulative}')
        out += [f"{self.name}_sum{labels} {self.total}", f"{self.name}_count{labels} {self.count}"]
        return out


class RequestMetrics:
    """What the front door knows of finished requests (one per AsyncEngine)."""

    def __init__(self) -> None:
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token, seconds.", TTFT_BUCKETS
        )
        self.tpot = Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Mean time per output token after the first, per request, seconds.",
            TPOT_BUCKETS,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Admission to the final output, seconds.",
            E2E_BUCKETS,
        )
        # Speculative decoding, per finished request that verified drafts.
        self.spec_length = Histogram(
            "kvloom_request_spec_mean_accepted_length",
            "Tokens emitted per verification step (1 + accepted drafts), per request.",
            SPEC_LENGTH_BUCKETS,
        )
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests_by_reason: dict[str, int] = {}

    def observe(self, engine_metrics: dict, e2e_s: float, prompt: int, generated: int, reason):
        if "ttft_s" in engine_metrics:
            self.ttft.observe(float(engine_metrics["ttft_s"]))
        if "tpot_s" in engine_metrics:
            self.tpot.observe(float(engine_metrics["tpot_s"]))
        if "spec_mean_accepted_length" in engine_metrics:
            self.spec_length.observe(float(engine_metrics["spec_mean_accepted_length"]))
        self.e2e.observe(e2e_s)
        self.prompt_tokens += prompt
        self.generation_tokens += generated
        key = str(reason or "unknown")
        self.requests_by_reason[key] = self.requests_by_reason.get(key, 0) + 1

    def lines(self, labels: str) -> list[str]:
        out = []
        for name, value, text in (
            ("vllm:prompt_tokens_total", self.prompt_tokens, "Prompt tokens of finished requests."),
            (
                "vllm:generation_tokens_total",
                self.generation_tokens,
                "Generated tokens of finished requests.",
            ),
        ):
            out += [f"# HELP {name} {text}", f"# TYPE {name} counter", f"{name}{labels} {value}"]
        name = "vllm:request_success_total"
        out += [f"# HELP {name} Finished requests by finish reason.", f"# TYPE {name} counter"]
        inner = labels[1:-1] + "," if labels else ""
        for reason, n in sorted(self.requests_by_reason.items()):
            out.append(f'{name}{{{inner}finished_reason="{reason}"}} {n}')
        for histogram in (self.ttft, self.tpot, self.e2e, self.spec_length):
            out += histogram.lines(labels)
        return out
