"""Engine configuration: one dataclass per concern, each validated on construction.

Every invalid value raises `ValueError` naming the field and the allowed range
(invariant 10: bad configuration fails loudly at start).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

DTYPES = ("auto", "float32", "float64", "bfloat16", "float16")
# vLLM's names; "fp8" is e4m3 (float8_e4m3fn), the format H100/H200 tensor cores read.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def require(ok: bool, field_name: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{field_name} must be {allowed}, got {value!r}")


def require_int(
    field_name: str, value: Any, low: int, high: int | None = None, why: str = ""
) -> None:
    in_range = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if high is not None:
        in_range = in_range and value <= high
    allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    require(in_range, field_name, allowed + why, value)


@dataclass
class ModelConfig:
    """What to load: a Hugging Face checkpoint directory (or a Hub repo id, resolved to its
    snapshot in the Hugging Face cache: contracts/model_source.py) and the compute dtype."""

    model: str
    dtype: str = "auto"
    # The Hub revision (branch, tag or commit) of a repo id; None: the default branch.
    revision: str | None = None
    max_model_len: int | None = None
    seed: int = 0
    # "safetensors" reads the checkpoint; "dummy" fills the weights with seeded random
    # values (benchmarks of real model shapes without multi-GB files; needs only config.json).
    load_format: str = "safetensors"
    # CUDA graphs: uniform-decode steps of up to `max_cuda_graph_batch_size` rows replay a
    # captured graph on CUDA (single rank); `enforce_eager` turns them off.
    enforce_eager: bool = False
    max_cuda_graph_batch_size: int = 256
    # Batch-invariant kernel plans (docs/configuration.md "Deterministic mode"): a request's
    # tokens do not depend on batch composition, chunking, prefix hits or preemption.
    # Checked against the rest of the config in EngineConfig (check_deterministic).
    deterministic: bool = False
    hf_config: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        require(
            isinstance(self.model, str | os.PathLike),
            "model",
            "a directory path or a Hugging Face repo id",
            self.model,
        )
        require(
            self.revision is None or (isinstance(self.revision, str) and bool(self.revision)),
            "revision",
            "a non-empty string or None",
            self.revision,
        )
        self.model = str(self.model)
        if not Path(self.model).is_dir():
            # Imported here: workers receive configs already resolved (and it may import
            # huggingface_hub).
            from kvloom.contracts.model_source import resolve_model

            self.model = resolve_model(self.model, self.revision)
        path = Path(self.model)
        require(path.is_dir(), "model", "an existing Hugging Face checkpoint directory", self.model)
        config_file = path / "config.json"
        require(config_file.is_file(), "model", "a directory containing config.json", self.model)
        require(self.dtype in DTYPES, "dtype", f"one of {DTYPES}", self.dtype)
        formats = ("safetensors", "dummy")
        require(self.load_format in formats, "load_format", f"one of {formats}", self.load_format)
        require_int("seed", self.seed, 0)
        require(isinstance(self.enforce_eager, bool), "enforce_eager", "a bool", self.enforce_eager)
        require(isinstance(self.deterministic, bool), "deterministic", "a bool", self.deterministic)
        require_int("max_cuda_graph_batch_size", self.max_cuda_graph_batch_size, 1, 4096)
        if not self.hf_config:
            self.hf_config = json.loads(config_file.read_text())
        text_config = self.text_config
        require(
            bool(text_config.get("architectures") or self.hf_config.get("architectures")),
            "config.json architectures",
            "a non-empty list",
            None,
        )
        # Kimi-Linear's config names its context limit model_max_length.
        key = next(
            (k for k in ("max_position_embeddings", "model_max_length") if text_config.get(k)),
            None,
        )
        derived = int(text_config[key]) if key else 4096
        if self.max_model_len is None:
            self.max_model_len = derived
        require_int("max_model_len", self.max_model_len, 2)
        # Positions past the model's own limit have no rotary table entry (and were never
        # trained): refused at start, as vLLM does.
        if key is not None:
            require_int(
                "max_model_len",
                self.max_model_len,
                2,
                derived,
                why=f" (the model's {key} in config.json)",
            )

    @property
    def text_config(self) -> dict:
        """The language-model part (multimodal checkpoints nest it under text_config; a
        tie_word_embeddings or quantization_config set only beside it applies to it: the
        models read the latter to keep differently quantized parts out of one fused layer)."""
        nested = self.hf_config.get("text_config")
        if not nested:
            return self.hf_config
        for key in ("tie_word_embeddings", "quantization_config"):
            if key not in nested and key in self.hf_config:
                nested = {**nested, key: self.hf_config[key]}
        return nested

    @property
    def quantization(self) -> dict | None:
        """The checkpoint's own `quantization_config` (None: float weights); parsed and
        validated when the workers build the model (workers/layers/quantization)."""
        return self.hf_config.get("quantization_config") or self.text_config.get(
            "quantization_config"
        )

    @property
    def architecture(self) -> str:
        archs = self.hf_config.get("architectures") or self.text_config.get("architectures")
        return archs[0]

    @property
    def torch_dtype_name(self) -> str:
        """The dtype to compute in: explicit, else the checkpoint's, else float32."""
        if self.dtype != "auto":
            return self.dtype
        saved = self.hf_config.get("dtype") or self.hf_config.get("torch_dtype") or "float32"
        return saved if saved in DTYPES else "float32"


@dataclass
class CacheConfig:
    """The paged KV cache: page geometry, pool size, prefix caching, sanitizer."""

    # Tokens per KV-cache block. None: 16, hybrids included (a recurrent state spans
    # several pool pages: docs/kv_cache_pages.md). A value set is always kept.
    block_size: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    # How sliding-window layers are booked for caching: "window" frees blocks outside the
    # window; "full" keeps them like full attention (the window is still enforced at
    # compute) so their prefix hits match full attention's; "auto" picks "full" when every
    # attention layer is sliding-window and prefix caching is on.
    sliding_window_booking: str = "auto"
    # None: on when the environment sets KVLOOM_SANITIZE=1 (the test suite does).
    sanitize: bool | None = None
    # Dtype of linear-attention recurrent state (Gated DeltaNet, KDA): "float32" (float64
    # for float64 models) is exact across long decodes; "auto" (the model dtype, vLLM's
    # default) or "bfloat16"/"float16" halve the state's pages and its per-step traffic.
    linear_state_dtype: str = "float32"
    # Dtype of attention KV pages (full, sliding-window, MLA latent): "auto" (the model
    # dtype) or "fp8" / "fp8_e4m3" (float8_e4m3fn with the checkpoint's per-tensor k/v
    # scales, else 1.0: docs/configuration.md). Linear state keeps `linear_state_dtype`.
    kv_cache_dtype: str = "auto"
    # Linear-state checkpoints (prefix caching on hybrid models, docs/kv_cache_pages.md):
    # kept at the end of every finished or preempted request and of every prompt's
    # prefill, and every `linear_state_checkpoint_interval` tokens of a prefill (0: off;
    # a multiple of block_size cuts prefill chunks there). At most
    # `max_linear_state_checkpoints` are kept per state group (None: as many as fit in
    # half the pool; 0: none), evicted least recently used first.
    linear_state_checkpoint_interval: int = 0
    max_linear_state_checkpoints: int | None = None

    def __post_init__(self) -> None:
        require_int("linear_state_checkpoint_interval", self.linear_state_checkpoint_interval, 0)
        if self.max_linear_state_checkpoints is not None:
            require_int("max_linear_state_checkpoints", self.max_linear_state_checkpoints, 0)
        if self.block_size is not None:
            require_int("block_size", self.block_size, 1, 4096)
        if self.num_kv_blocks is not None:
            require_int("num_kv_blocks", self.num_kv_blocks, 2)
        if self.kv_cache_memory_bytes is not None:
            require_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        ok = isinstance(self.gpu_memory_utilization, int | float)
        require(
            ok and 0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            "a number in (0, 1]",
            self.gpu_memory_utilization,
        )
        bookings = ("auto", "window", "full")
        require(
            self.sliding_window_booking in bookings,
            "sliding_window_booking",
            f"one of {bookings}",
            self.sliding_window_booking,
        )
        state_dtypes = ("float32", "auto", "bfloat16", "float16")
        require(
            self.linear_state_dtype in state_dtypes,
            "linear_state_dtype",
            f"one of {state_dtypes}",
            self.linear_state_dtype,
        )
        require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            f"one of {KV_CACHE_DTYPES}",
            self.kv_cache_dtype,
        )
        if self.sanitize is None:
            self.sanitize = os.environ.get("KVLOOM_SANITIZE", "") not in ("", "0")


@dataclass
class SchedulerConfig:
    """The token budget of one step and how prefills are chunked."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0
    max_model_len: int = 4096
    # Schedule and launch step N+1 while step N runs on the device (its sampled ids feed
    # N+1's inputs there), hiding the host's per-step work. None: on for one CUDA rank.
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        require(
            self.async_scheduling is None or isinstance(self.async_scheduling, bool),
            "async_scheduling",
            "a bool or None",
            self.async_scheduling,
        )
        require_int("max_num_seqs", self.max_num_seqs, 1)
        require_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        require_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        require_int("max_model_len", self.max_model_len, 2)


@dataclass
class ParallelConfig:
    """Worker grid: tensor parallel × decode context parallel, and how it is hosted."""

    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    executor: str = "auto"

    def __post_init__(self) -> None:
        require_int("tensor_parallel_size", self.tensor_parallel_size, 1, 1024)
        require_int("decode_context_parallel_size", self.decode_context_parallel_size, 1, 1024)
        executors = ("auto", "inprocess", "ray")
        require(self.executor in executors, "executor", f"one of {executors}", self.executor)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.decode_context_parallel_size


SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp", "dflash")
# Methods whose drafter is a separate checkpoint directory (`model`); `mtp` reads the
# target's own `mtp.*` tensors and `ngram` has no weights.
SPEC_METHODS_WITH_MODEL = ("draft_model", "eagle", "eagle3", "dflash")
SPEC_PLACEMENTS = ("local", "remote")


@dataclass
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts tokens that the target verifies in one step.

    Given as `speculative_config={"method": "ngram", "num_speculative_tokens": 3}` or
    `{"method": "eagle3", "model": DIR, "num_speculative_tokens": 3}` (vLLM's names).
    """

    method: str | None = None
    num_speculative_tokens: int = 0
    # The drafter's checkpoint directory (vLLM's key). draft_model: a model with the
    # target's tokenizer; eagle: a KvloomEagleHead dir; eagle3 / dflash: published heads.
    model: str | None = None
    # Older spelling of `model`, kept so existing configs keep working.
    draft_model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # "remote": the drafter runs in its own Ray actor (issue 21 item 4).
    placement: str = "local"

    def __post_init__(self) -> None:
        if self.model is not None and self.draft_model is not None:
            require(
                self.model == self.draft_model,
                "speculative_config.model",
                "the same directory as speculative_config.draft_model (give one of them)",
                self.model,
            )
        model = self.model or self.draft_model
        if isinstance(model, os.PathLike):
            model = os.fspath(model)
        self.model = self.draft_model = model
        if self.method is None:
            self.num_speculative_tokens = 0
            return
        require(
            self.method in SPEC_METHODS,
            "speculative_config.method",
            f"one of {SPEC_METHODS}",
            self.method,
        )
        require_int("speculative_config.num_speculative_tokens", self.num_speculative_tokens, 1, 16)
        require_int("speculative_config.prompt_lookup_min", self.prompt_lookup_min, 1)
        require_int(
            "speculative_config.prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min
        )
        require(
            self.placement in SPEC_PLACEMENTS,
            "speculative_config.placement",
            f"one of {SPEC_PLACEMENTS}",
            self.placement,
        )
        if self.method in SPEC_METHODS_WITH_MODEL:
            require(
                isinstance(self.model, str) and Path(self.model).is_dir(),
                "speculative_config.model",
                "a checkpoint directory",
                self.model,
            )

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots a request needs beyond its computed tokens for one speculative step.
        The one source for this number (invariant 6): allocation and sizing both use it."""
        return self.num_speculative_tokens


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: str = "auto"
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Builds the config from the flat keyword arguments of `LLM(...)` / `Engine(...)`."""
        kwargs = dict(kwargs)
        device = kwargs.pop("device", "auto")
        spec = kwargs.pop("speculative_config", None) or {}
        if isinstance(spec, SpeculativeConfig):
            speculative = spec
        elif isinstance(spec, dict):
            unknown = set(spec) - {f.name for f in fields(SpeculativeConfig)}
            if unknown:
                raise ValueError(f"speculative_config: unknown key(s) {', '.join(sorted(unknown))}")
            speculative = SpeculativeConfig(**spec)
        else:
            raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
        parts: dict[str, dict[str, Any]] = {}
        for name, klass in (
            ("model", ModelConfig),
            ("cache", CacheConfig),
            ("scheduler", SchedulerConfig),
            ("parallel", ParallelConfig),
        ):
            names = {f.name for f in fields(klass)} - {"hf_config"}
            parts[name] = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        if kwargs:
            raise ValueError(f"unknown engine argument(s): {', '.join(sorted(kwargs))}")
        if "model" not in parts["model"]:
            raise ValueError("model must be a Hugging Face checkpoint directory, got nothing")
        model = ModelConfig(**parts["model"])
        parts["scheduler"]["max_model_len"] = model.max_model_len
        require(device in ("auto", "cpu", "cuda"), "device", "one of auto, cpu, cuda", device)
        config = cls(
            model=model,
            cache=CacheConfig(**parts["cache"]),
            scheduler=SchedulerConfig(**parts["scheduler"]),
            parallel=ParallelConfig(**parts["parallel"]),
            device=device,
            speculative=speculative,
        )
        check_deterministic(config)
        return config


# Architectures whose every kernel has a batch-invariant plan (kernels/batch_invariant.py).
DETERMINISTIC_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)


def check_deterministic(config: EngineConfig) -> None:
    """`deterministic=True` with a setting whose kernels have no batch-invariant plan yet
    is refused by name (invariant 10), never silently not honoured."""
    if not config.model.deterministic:
        return
    unsupported = []
    if config.model.architecture not in DETERMINISTIC_ARCHITECTURES:
        unsupported.append(f"architecture {config.model.architecture} (MLA / KDA kernels)")
    if config.parallel.tensor_parallel_size > 1:
        unsupported.append("tensor_parallel_size > 1 (all-reduce order)")
    if config.parallel.decode_context_parallel_size > 1:
        unsupported.append("decode_context_parallel_size > 1 (sharded attention)")
    if config.speculative.enabled:
        unsupported.append("speculative_config (draft and verify plans)")
    if config.model.quantization:
        unsupported.append("a quantized checkpoint (FP8 / int4 GEMMs)")
    if unsupported:
        raise ValueError(
            "deterministic=True is not supported with " + "; ".join(unsupported) + " yet"
        )
