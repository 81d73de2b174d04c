"""Reads a checkpoint's `quantization_config` (config.json) into per-module schemes.

Never guessed: the method, formats, bit widths, strategies and group sizes are the
checkpoint's own, and anything kvloom does not implement raises ValueError naming the
field. Four methods:

* `quant_method: "fp8"` (DeepSeek-V3 / Qwen3 / Qwen3-Next FP8): e4m3 weights in
  `weight_block_size` [bn, bk] blocks with `weight_scale_inv` per block, activations
  quantized at run time per token and bk group (`activation_scheme: "dynamic"`). Modules
  listed in `modules_to_not_convert` (or `ignored_layers`) stay in the float dtype.
* `quant_method: "gptq"` (AutoGPTQ / GPTQModel int4): no activation order, read as W4A16
  (int4_layouts.py turns its tensors into compressed-tensors' layout), with a zero-point
  offset per group where `sym` is false (as AWQ); the modules it quantized are those with
  a `qweight` in the checkpoint (`bind_checkpoint`).
* `quant_method: "awq"` (AutoAWQ's GEMM layout): int4 with zero points, read as W4A16 with
  a zero-point offset per group (int4_layouts.py turns its tensors into that layout).
* `quant_method: "compressed-tensors"` (llm-compressor; Kimi's INT4 checkpoints): each
  `config_groups` entry applies a scheme to its `targets` (class name "Linear", exact
  module names or "re:" regexes), minus `ignore`. Formats: `float-quantized` FP8 weights
  per channel or per tensor (`weight_scale`, optional static `input_scale`) or in blocks;
  `pack-quantized` int4 group-quantized weights (`weight_packed`, `weight_scale`,
  `weight_shape`; asymmetric ones add `weight_zero_point`) with float activations (W4A16).

Module names are the checkpoint's (e.g. `model.layers.0.mlp.experts.3.gate_proj`), so the
rules match what the checkpoint's authors wrote.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

FIELD = "quantization_config"
FP8_KNOWN = {
    "quant_method",
    "fmt",
    "activation_scheme",
    "weight_block_size",
    "modules_to_not_convert",
    "ignored_layers",
    "scale_fmt",
}
CT_KNOWN = {
    "quant_method",
    "format",
    "quantization_status",
    "config_groups",
    "ignore",
    "kv_cache_scheme",  # the FP8 KV cache's business (kv_cache_dtype), not the weights'
    "global_compression_ratio",
    "sparsity_config",
    "transform_config",
    "version",
    "provider",
}
CT_FORMATS = ("float-quantized", "pack-quantized", "naive-quantized")
# GPTQ's checkpoint formats -> the qzeros value of a symmetric int4 layer (z = 8): the
# original format stores z - 1.
GPTQ_STORED_ZERO = {"gptq": 7, "gptq_v2": 8}
# Fields of compressed-tensors QuantizationArgs that do not change how weights are stored.
CT_ARGS_IGNORED = {"observer", "observer_kwargs", "block_structure", "zp_dtype", "scale_dtype"}


@dataclass(frozen=True)
class Fp8Scheme:
    """FP8 e4m3 weights and activations. `block` = (bn, bk) for block-scaled weights;
    None for one scale per output channel (`per_tensor`: one per checkpoint tensor).
    `static_input`: a per-tensor `input_scale` tensor instead of dynamic per-token scales."""

    block: tuple[int, int] | None
    scale_name: str
    per_tensor: bool = False
    static_input: bool = False

    @property
    def name(self) -> str:
        if self.block:
            return f"fp8-block{self.block[0]}x{self.block[1]}"
        return "fp8-tensor" if self.per_tensor else "fp8-channel"


@dataclass(frozen=True)
class W4A16Scheme:
    """int4 weights, one scale per `group_size` input features; float activations.
    Symmetric (w = q * s), or with `zero_point` (AWQ: w = (q - z) * s, a z per group)."""

    group_size: int
    zero_point: bool = False

    @property
    def name(self) -> str:
        return f"w4a16-g{self.group_size}" + ("-zp" if self.zero_point else "")


Scheme = Fp8Scheme | W4A16Scheme


def _fail(path: str, allowed: str, value: Any) -> None:
    raise ValueError(f"{FIELD}.{path} must be {allowed}, got {value!r}")


def _check_known(cfg: dict, known: set, path: str) -> None:
    for key in cfg:
        if key not in known:
            raise ValueError(
                f"{FIELD}.{path}{key} is not supported by kvloom (known fields: "
                f"{', '.join(sorted(known))})"
            )


def _names(cfg: dict, key: str, path: str) -> tuple[str, ...]:
    value = cfg.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        _fail(path + key, "a list of module names", value)
    return tuple(value)


def _block_size(value) -> tuple[int, int]:
    ok = (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )
    if not ok or any(v < 16 or v > 512 or v & (v - 1) for v in value):
        _fail("weight_block_size", "two powers of two in [16, 512] (e.g. [128, 128])", value)
    return int(value[0]), int(value[1])


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern


def _not_converted(name: str, entry: str) -> bool:
    """modules_to_not_convert entries name a module or any dotted part of its path."""
    return re.search(rf"(^|\.){re.escape(entry)}($|\.)", name) is not None


class QuantizationConfig:
    """The schemes of one checkpoint. `scheme_for(names)` answers for one kvloom module
    made of the checkpoint modules `names` (fused parts, or every expert of a MoE)."""

    def __init__(self, method: str, rules: list[tuple[tuple[str, ...], Scheme]], ignore, fp8):
        self.method = method
        self.rules = rules  # (targets, scheme) in config order
        self.ignore = ignore
        self._fp8_block = fp8  # "fp8": every module not ignored
        self.gptq_stored_zero: int | None = None  # "gptq": qzeros of a symmetric layer
        self._quantized: set[str] | None = None  # "gptq", "awq": modules with a qweight

    def bind_checkpoint(self, modules: set[str]) -> None:
        """GPTQ and AWQ configs name no modules: the checkpoint's quantized ones are
        `modules` (those with a qweight: int4_layouts.qweight_modules); every other
        module is float."""
        self._quantized = set(modules)

    def _one(self, name: str) -> Scheme | None:
        if self._quantized is not None:
            return self.rules[0][1] if name in self._quantized else None
        if self._fp8_block is not None:
            return None if any(_not_converted(name, e) for e in self.ignore) else self._fp8_block
        if any(_matches(name, p) for p in self.ignore):
            return None
        for targets, scheme in self.rules:
            # "Linear" targets every linear layer: each module kvloom asks about is one.
            if any(t == "Linear" or _matches(name, t) for t in targets):
                return scheme
        return None

    def scheme_for(self, names: list[str], what: str) -> Scheme | None:
        schemes = {n: self._one(n) for n in names}
        distinct = set(schemes.values())
        if len(distinct) > 1:
            shown = ", ".join(f"{n}: {s.name if s else 'float'}" for n, s in schemes.items())
            raise ValueError(
                f"{FIELD}: the parts of {what} are quantized differently ({shown}); kvloom "
                "fuses them into one layer, which needs one scheme"
            )
        return next(iter(distinct), None)


def _parse_fp8(cfg: dict) -> QuantizationConfig:
    _check_known(cfg, FP8_KNOWN, "")
    if cfg.get("fmt", "e4m3") != "e4m3":
        _fail("fmt", "'e4m3'", cfg.get("fmt"))
    if cfg.get("activation_scheme", "dynamic") != "dynamic":
        _fail(
            "activation_scheme",
            "'dynamic' (static FP8 activations are not supported)",
            cfg.get("activation_scheme"),
        )
    if cfg.get("scale_fmt") not in (None, "float32"):
        # ue8m0 (DeepSeek-V3.1) also rounds activation scales to powers of two.
        _fail(
            "scale_fmt", "absent or 'float32' ('ue8m0' scales are not supported)", cfg["scale_fmt"]
        )
    if cfg.get("weight_block_size") is None:
        _fail(
            "weight_block_size",
            "set (per-tensor 'fp8' checkpoints are not supported; block-scaled ones are)",
            None,
        )
    block = _block_size(cfg["weight_block_size"])
    ignore = _names(cfg, "modules_to_not_convert", "") + _names(cfg, "ignored_layers", "")
    return QuantizationConfig("fp8", [], ignore, Fp8Scheme(block, "weight_scale_inv"))


def _check_args(args: dict, path: str) -> None:
    known = {
        "num_bits",
        "type",
        "symmetric",
        "group_size",
        "strategy",
        "block_structure",
        "dynamic",
        "actorder",
        "observer",
        "observer_kwargs",
        "zp_dtype",
        "scale_dtype",
    }
    _check_known(args, known, path)


def _ct_scheme(group: dict, fmt: str, path: str) -> Scheme:
    weights = group.get("weights")
    if not isinstance(weights, dict):
        _fail(path + "weights", "a weights quantization spec", weights)
    _check_args(weights, path + "weights.")
    acts = group.get("input_activations")
    if group.get("output_activations") is not None:
        _fail(
            path + "output_activations",
            "null (output quantization is not supported)",
            group["output_activations"],
        )
    if weights.get("actorder") not in (None, "static"):
        _fail(
            path + "weights.actorder",
            "null or 'static' (activation reordering needs g_idx)",
            weights["actorder"],
        )
    if weights.get("dynamic", False) is not False:
        _fail(path + "weights.dynamic", "false", weights.get("dynamic"))
    symmetric = weights.get("symmetric", True)
    if symmetric is not True and not (symmetric is False and fmt == "pack-quantized"):
        _fail(
            path + "weights.symmetric",
            "true (false only for pack-quantized int4 weights)",
            weights.get("symmetric"),
        )
    strategy = weights.get("strategy")
    if fmt == "pack-quantized":
        if weights.get("type") != "int" or weights.get("num_bits") != 4:
            _fail(
                path + "weights",
                "4-bit int for pack-quantized",
                {k: weights.get(k) for k in ("type", "num_bits")},
            )
        if strategy != "group":
            _fail(path + "weights.strategy", "'group' for int4 weights", strategy)
        group_size = weights.get("group_size")
        if group_size not in (32, 64, 128):
            _fail(path + "weights.group_size", "32, 64 or 128", group_size)
        if acts is not None:
            _fail(path + "input_activations", "null for W4A16 (float activations)", acts)
        # asymmetric: `weight_zero_point` per group, kept as AWQ's (ct_zero_points.py)
        return W4A16Scheme(int(group_size), zero_point=not symmetric)
    # float-quantized / naive-quantized FP8
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        _fail(
            path + "weights",
            "8-bit float for float-quantized",
            {k: weights.get(k) for k in ("type", "num_bits")},
        )
    if not isinstance(acts, dict):
        _fail(
            path + "input_activations",
            "an 8-bit float activation spec (W8A16 FP8 is not supported)",
            acts,
        )
    _check_args(acts, path + "input_activations.")
    if acts.get("type") != "float" or acts.get("num_bits") != 8:
        _fail(
            path + "input_activations",
            "8-bit float",
            {k: acts.get(k) for k in ("type", "num_bits")},
        )
    if strategy == "block":
        block = _block_size(weights.get("block_structure"))
        ok = acts.get("dynamic") is True and acts.get("strategy") == "group"
        if not ok or acts.get("group_size") != block[1]:
            _fail(path + "input_activations", f"dynamic per-group with group_size {block[1]}", acts)
        return Fp8Scheme(block, "weight_scale")
    if strategy not in ("channel", "tensor"):
        _fail(path + "weights.strategy", "'channel', 'tensor' or 'block' for FP8 weights", strategy)
    if acts.get("dynamic") is True:
        if acts.get("strategy") != "token":
            _fail(
                path + "input_activations.strategy",
                "'token' for dynamic FP8 activations",
                acts.get("strategy"),
            )
        static = False
    elif acts.get("dynamic") is False:
        if acts.get("strategy") != "tensor":
            _fail(
                path + "input_activations.strategy",
                "'tensor' for static FP8 activations",
                acts.get("strategy"),
            )
        static = True
    else:
        _fail(path + "input_activations.dynamic", "true or false", acts.get("dynamic"))
    return Fp8Scheme(None, "weight_scale", per_tensor=strategy == "tensor", static_input=static)


def _parse_compressed_tensors(cfg: dict) -> QuantizationConfig:
    _check_known(cfg, CT_KNOWN, "")
    status = cfg.get("quantization_status", "compressed")
    if status != "compressed":
        _fail("quantization_status", "'compressed' (weights stored quantized)", status)
    if cfg.get("sparsity_config"):
        _fail(
            "sparsity_config", "null (sparse checkpoints are not supported)", cfg["sparsity_config"]
        )
    if cfg.get("transform_config"):
        _fail(
            "transform_config",
            "null (transformed checkpoints are not supported)",
            cfg["transform_config"],
        )
    groups = cfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        _fail("config_groups", "a non-empty mapping of scheme groups", groups)
    rules = []
    for name, group in groups.items():
        path = f"config_groups.{name}."
        if not isinstance(group, dict):
            _fail(path[:-1], "a mapping", group)
        _check_known(
            group, {"targets", "weights", "input_activations", "output_activations", "format"}, path
        )
        fmt = group.get("format") or cfg.get("format")
        if fmt not in CT_FORMATS:
            _fail(path + "format" if group.get("format") else "format", f"one of {CT_FORMATS}", fmt)
        targets = _names(group, "targets", path)
        if not targets:
            _fail(path + "targets", "a non-empty list", group.get("targets"))
        rules.append((targets, _ct_scheme(group, fmt, path)))
    return QuantizationConfig("compressed-tensors", rules, _names(cfg, "ignore", ""), None)


def parse_quantization_config(cfg: dict | None) -> QuantizationConfig | None:
    """The checkpoint's `quantization_config` (None: a float checkpoint)."""
    if cfg is None:
        return None
    if not isinstance(cfg, dict):
        raise ValueError(f"{FIELD} must be a mapping, got {type(cfg).__name__}")
    method = cfg.get("quant_method")
    if method == "fp8":
        return _parse_fp8(cfg)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(cfg)
    if method == "gptq":
        return _parse_gptq(cfg)
    if method == "awq":
        return _parse_awq(cfg)
    raise ValueError(
        f"{FIELD}.quant_method {method!r} is not supported; kvloom reads 'fp8' (block-scaled), "
        "'compressed-tensors' (float-quantized FP8, pack-quantized W4A16), 'gptq' "
        "(int4) and 'awq' (int4 with zero points, GEMM layout)"
    )


def _int4_group_size(cfg: dict) -> int:
    if cfg.get("bits", cfg.get("w_bit")) != 4:
        _fail("bits", "4 (kvloom reads int4 checkpoints)", cfg.get("bits", cfg.get("w_bit")))
    group = cfg.get("group_size", cfg.get("q_group_size"))
    if not isinstance(group, int) or isinstance(group, bool) or group < 8 or group % 8:
        _fail("group_size", "a positive multiple of 8 (-1, one group per row, is not read)", group)
    return group


def _parse_awq(cfg: dict) -> QuantizationConfig:
    """AutoAWQ's config; producer fields (modules_to_not_convert among them: the modules
    with a qweight are the quantized ones) do not change storage and are not read."""
    group = _int4_group_size(cfg)
    if cfg.get("zero_point", True) is not True:
        _fail("zero_point", "true (AWQ without zero points is not supported)", cfg["zero_point"])
    version = str(cfg.get("version", "gemm")).lower()
    if version != "gemm":
        _fail("version", "'gemm' (the GEMV, Marlin and ExLlama layouts are not read)", version)
    scheme = W4A16Scheme(group, zero_point=True)
    return QuantizationConfig("awq", [(("Linear",), scheme)], ("lm_head",), None)


def _parse_gptq(cfg: dict) -> QuantizationConfig:
    """GPTQ configs carry many producer fields (damp_percent, true_sequential, meta, ...)
    that do not change how weights are stored; these are the ones that do."""
    group = _int4_group_size(cfg)
    sym = cfg.get("sym")
    if not isinstance(sym, bool):
        _fail("sym", "true or false", sym)
    if cfg.get("desc_act", False) is not False:
        _fail("desc_act", "false (activation reordering is not supported)", cfg.get("desc_act"))
    fmt = cfg.get("checkpoint_format") or cfg.get("format") or "gptq"
    if fmt not in GPTQ_STORED_ZERO:
        field = "checkpoint_format" if cfg.get("checkpoint_format") else "format"
        _fail(field, f"one of {tuple(GPTQ_STORED_ZERO)}", fmt)
    if cfg.get("is_marlin_format"):
        _fail("is_marlin_format", "false", cfg["is_marlin_format"])
    if cfg.get("lm_head"):
        _fail("lm_head", "false (a quantized lm_head is not supported)", cfg["lm_head"])
    if cfg.get("dynamic"):
        _fail("dynamic", "empty (per-module overrides are not supported)", cfg["dynamic"])
    scheme = W4A16Scheme(group, zero_point=not sym)  # asymmetric: zero points, as AWQ's
    qconfig = QuantizationConfig("gptq", [(("Linear",), scheme)], ("lm_head",), None)
    qconfig.gptq_stored_zero = GPTQ_STORED_ZERO[fmt]
    return qconfig
