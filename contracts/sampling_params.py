"""Per-request sampling parameters, shaped like vLLM's so users can switch."""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass, field
from typing import Any

from kvloom.contracts.config import require, require_int

# Temperatures below this sample greedily (vLLM's threshold).
GREEDY_BELOW = 1e-5


@dataclass
class StructuredOutputsParams:
    """Constrains the output to a shape (vLLM's names); exactly one field is set.

    json: a JSON schema (dict or JSON text); regex: a regular expression the whole output
    matches; choice: the output is one of these strings; grammar: an EBNF grammar
    (GBNF-style, with a `root` rule); json_object: any JSON object; structural_tag:
    xgrammar's structural-tag JSON text (what a forced tool_choice compiles to). Compiled
    by cluster/structured_outputs/ (xgrammar) off the engine loop."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        names = ("json", "regex", "choice", "grammar", "structural_tag")
        given = [name for name in names if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        require(
            len(given) == 1,
            "structured_outputs",
            "exactly one of json, regex, choice, grammar, json_object, structural_tag",
            given or "none",
        )
        require(
            isinstance(self.json_object, bool),
            "structured_outputs.json_object",
            "a bool",
            self.json_object,
        )
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = jsonlib.loads(schema)
                except ValueError as err:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {err}") from None
            require(
                isinstance(schema, dict | bool),
                "structured_outputs.json",
                "a JSON schema (an object, or its JSON text)",
                self.json,
            )
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None:
                require(
                    isinstance(value, str) and value != "",
                    f"structured_outputs.{name}",
                    "a non-empty string",
                    value,
                )
        if self.choice is not None:
            require(
                isinstance(self.choice, list | tuple)
                and len(self.choice) > 0
                and all(isinstance(c, str) and c for c in self.choice),
                "structured_outputs.choice",
                "a non-empty list of non-empty strings",
                self.choice,
            )
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        """Which constraint is set: json, regex, choice, grammar, structural_tag or
        json_object."""
        for name in ("json", "regex", "choice", "grammar", "structural_tag"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @property
    def spec(self) -> str:
        """The constraint as text: with `kind`, the grammar cache's key."""
        kind = self.kind
        if kind == "json_object":
            return ""
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, str):
            return jsonlib.dumps(value)  # key order kept: it is the output order
        if kind == "choice":
            return jsonlib.dumps(value)
        return value


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # False: token ids only, no text (benchmarks; vLLM's flag). Stop strings need text.
    detokenize: bool = True
    # "cumulative": `Engine.step` returns the request's output each step it advances;
    # "final_only": only when it finishes (what `LLM.generate` needs; saves host time).
    output_kind: str = "cumulative"
    # Output constrained by a grammar (JSON schema, regex, choice, EBNF, any JSON object).
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine from generation_config.json; not a user knob.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    @property
    def reads_token_history(self) -> bool:
        """Whether sampling reads the request's earlier tokens (the penalties)."""
        return (
            self.repetition_penalty != 1.0
            or bool(self.presence_penalty)
            or bool(self.frequency_penalty)
        )

    def __post_init__(self) -> None:
        require(self.n == 1, "n", "1 (parallel sampling is not supported yet)", self.n)
        if self.max_tokens is not None:
            require_int("max_tokens", self.max_tokens, 1)
        require_int("min_tokens", self.min_tokens, 0)
        require(
            _is_number(self.temperature) and self.temperature >= 0,
            "temperature",
            "a number >= 0",
            self.temperature,
        )
        require(
            _is_number(self.top_p) and 0 < self.top_p <= 1,
            "top_p",
            "a number in (0, 1]",
            self.top_p,
        )
        require(
            isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
            "top_k",
            "-1 (disabled) or an integer >= 1",
            self.top_k,
        )
        require(
            _is_number(self.min_p) and 0 <= self.min_p <= 1,
            "min_p",
            "a number in [0, 1]",
            self.min_p,
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            require(_is_number(value) and -2 <= value <= 2, name, "a number in [-2, 2]", value)
        require(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "a number > 0",
            self.repetition_penalty,
        )
        if self.seed is not None:
            require_int("seed", self.seed, 0, 2**63 - 1)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        require(isinstance(self.detokenize, bool), "detokenize", "a bool", self.detokenize)
        kinds = ("cumulative", "final_only")
        require(self.output_kind in kinds, "output_kind", f"one of {kinds}", self.output_kind)
        require(self.detokenize or not self.stop, "stop", "empty when detokenize=False", self.stop)
        for s in self.stop:
            require(isinstance(s, str) and s != "", "stop", "a list of non-empty strings", s)
        self.stop_token_ids = list(self.stop_token_ids or [])
        for t in self.stop_token_ids:
            require_int("stop_token_ids", t, 0)
        if self.logprobs is not None:
            require_int("logprobs", self.logprobs, 0, 1024)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        require(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "a StructuredOutputsParams",
            self.structured_outputs,
        )

    @property
    def greedy(self) -> bool:
        """Temperatures below GREEDY_BELOW are greedy (as vLLM does): dividing the logits
        by one that small overflows to inf - inf = NaN and samples garbage."""
        return self.temperature < GREEDY_BELOW


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value
