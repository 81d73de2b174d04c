"""Tiny quantized checkpoints in the published layouts, written from a float checkpoint.

`write_quantized(src, out, scheme)` quantizes the float checkpoint's linear weights as
each format's producer does and writes `out` with the format's tensor names, dtypes and
`quantization_config`; `write_dequantized(src, out, scheme)` writes the same weights
dequantized back to float (the reference model). Formats:

* "fp8_block": quant_method "fp8" (Qwen3 / Qwen3-Next FP8): `weight` float8_e4m3fn and
  `weight_scale_inv` bfloat16 [ceil(N / bn), ceil(K / bk)], `modules_to_not_convert`.
* "fp8_channel" / "fp8_tensor": compressed-tensors float-quantized: `weight` e4m3 and
  `weight_scale` float32 [N, 1] / [1], dynamic per-token activations.
* "w4a16_g32" / "w4a16_g128": compressed-tensors pack-quantized (Kimi): `weight_packed`
  int32 written by compressed-tensors' own `pack_to_int32`, `weight_scale` bfloat16
  [N, K / g], `weight_shape` int64 [2].
* "w4a16_asym_g32": the same with `symmetric: false`: min-max groups, a signed zero point
  per row and group in `weight_zero_point` int32 [N / 8, K / g], packed along N by
  compressed-tensors' own `pack_to_int32(..., packed_dim=0)`; the dequantized weight
  from the library's own unpacking.
* "gptq_g32" / "gptq_g128" (and "gptq_v2_g32"): quant_method "gptq" as AutoGPTQ /
  GPTQModel write it, symmetric, no activation order: `qweight` int32 [K / 8, N] packed
  along K, `qzeros` int32 [K / g, N / 8] packed along N (z - 1 = 7 in the original
  format, z = 8 in v2), `scales` float16 [K / g, N], `g_idx` int32 [K]. Written here from
  the format's definition, independently of kvloom's reader.
* "gptq_asym_g32" / "gptq_v2_asym_g32": the same with `sym: false`: a zero point z in
  [0, 15] per group and column (min-max quantization), stored as z - 1 (v1; z = 0 is not
  written there: it has no v1 encoding) or z (v2).
* "awq_g32" / "awq_g128": quant_method "awq", AutoAWQ's GEMM layout: `qweight` int32
  [K, N / 8] and `qzeros` int32 [K / g, N / 8] packed along N in AWQ's column order,
  `scales` float16 [K / g, N], asymmetric (zero points 0..15).

Only the projections of attention, linear attention, dense MLPs and experts are
quantized; embeddings, norms, routers, gates and lm_head stay float, as the released
checkpoints keep them.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
QUANTIZED = re.compile(
    r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|in_proj_qkvz|in_proj_qkv|"
    r"in_proj_z|out_proj)\.weight$"
)
KEEP_FLOAT = ["lm_head", "embed_tokens", "mlp.gate", "shared_expert_gate", "in_proj_ba"]
KEEP_FLOAT += ["in_proj_a", "in_proj_b"]  # Qwen3.5's split gates (Qwen's FP8 keeps them)
SCHEMES = ("fp8_block", "fp8_channel", "fp8_tensor", "w4a16_g32", "w4a16_g128")
GPTQ_SCHEMES = ("gptq_g32", "gptq_g128", "gptq_v2_g32")
GPTQ_ASYM_SCHEMES = ("gptq_asym_g32", "gptq_v2_asym_g32")
AWQ_SCHEMES = ("awq_g32", "awq_g128")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's packing: nibble i holds column AWQ_ORDER[i]


def _pack_awq(u: torch.Tensor) -> torch.Tensor:
    """[R, C] values in [0, 15] -> [R, C / 8] int32 as AutoAWQ's GEMM layout packs them:
    word w's nibble i (bits 4 * i) holds column 8 * w + AWQ_ORDER[i]."""
    words = torch.zeros(u.shape[0], u.shape[1] // 8, dtype=torch.int64)
    for i, col in enumerate(AWQ_ORDER):
        words |= u[:, col::8].to(torch.int64) << (4 * i)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def awq_weight(w: torch.Tensor, group: int):
    """AWQ's tensors of one [N, K] weight, asymmetric round-to-nearest per group (AWQ's
    scale search left out: the layout is the point) -> (tensors by suffix, dequantized)."""
    groups = w.float().unflatten(1, (-1, group))  # [N, K / g, g]
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15.0).clamp_min(1e-4).to(torch.float16)  # [N, K / g]
    zero = torch.round(-low / scale.float()).clamp(0, 15).to(torch.int64)
    u = (torch.round(groups / scale.float()[..., None]) + zero[..., None]).clamp(0, 15)
    u = u.flatten(1).to(torch.int64)  # [N, K]
    tensors = {
        "qweight": _pack_awq(u.t()),  # [K, N / 8]
        "qzeros": _pack_awq(zero.t()),  # [K / g, N / 8]
        "scales": scale.t().contiguous(),  # [K / g, N]
    }
    deq = (u.unflatten(1, (-1, group)) - zero[..., None]).float() * scale.float()[..., None]
    return tensors, deq.flatten(1)


def _pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """[R, C] values in [0, 15] -> [R, ceil(C / 8)] int32, eight consecutive columns per
    word, column c at bits 4 * (c % 8)."""
    cols = u.shape[1]
    padded = torch.zeros(u.shape[0], -(-cols // 8) * 8, dtype=torch.int64)
    padded[:, :cols] = u.to(torch.int64)
    words = (padded.unflatten(1, (-1, 8)) << torch.arange(0, 32, 4)).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def gptq_weight(w: torch.Tensor, group: int, v2: bool = False, sym: bool = True):
    """GPTQ's tensors of one [N, K] weight (round-to-nearest standing in for GPTQ's
    solver: the layout is the point) -> (tensors by suffix, dequantized float32)."""
    n, k = w.shape
    groups = w.float().unflatten(1, (-1, group))
    if sym:
        scale = (groups.abs().amax(dim=-1) / 7.0).clamp_min(1e-4).to(torch.float16)  # [N, K/g]
        zero = torch.full((n, k // group), 8, dtype=torch.int64)
    else:  # min-max over the group, as GPTQ's quantizer with sym=False
        low, high = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)
        scale = ((high - low) / 15.0).clamp_min(1e-4).to(torch.float16)
        zero = torch.round(-low / scale.float()).clamp(0 if v2 else 1, 15).to(torch.int64)
    u = torch.round(groups / scale.float()[..., None]) + zero[..., None]
    u = u.clamp(0, 15).to(torch.int64).flatten(1)  # GPTQ's unsigned values
    stored = zero if v2 else zero - 1  # the original format stores z - 1
    tensors = {
        "qweight": _pack_nibbles(u).t().contiguous(),  # along K: [N, K / 8] -> [K / 8, N]
        "qzeros": _pack_nibbles(stored.t().contiguous()),  # along N: [K / g, N / 8]
        "scales": scale.t().contiguous(),
        "g_idx": (torch.arange(k) // group).to(torch.int32),
    }
    shifted = (u.unflatten(1, (-1, group)) - zero[..., None]).float()
    deq = (shifted * scale.float()[..., None]).flatten(1)
    return tensors, deq


def _blocks(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """Per-block max |w| [ceil(N / bn), ceil(K / bk)] (partial edge blocks included)."""
    n, k = w.shape
    padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    padded[:n, :k] = w.abs()
    return padded.unflatten(0, (-1, bn)).unflatten(2, (-1, bk)).amax(dim=(1, 3))


def _expand(s: torch.Tensor, bn: int, bk: int, shape) -> torch.Tensor:
    return s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: shape[0], : shape[1]]


def quantize_weight(w: torch.Tensor, scheme: str, block=(128, 128)):
    """-> (tensors by suffix, dequantized float32 weight)."""
    if scheme.startswith("gptq"):
        group, v2, sym = int(scheme.split("_g")[-1]), "_v2_" in scheme, "_asym_" not in scheme
        return gptq_weight(w, group, v2=v2, sym=sym)
    if scheme.startswith("awq"):
        return awq_weight(w, int(scheme.split("_g")[-1]))
    w = w.float()
    if scheme == "fp8_block":
        bn, bk = block
        scale = (_blocks(w, bn, bk) / 448.0).clamp_min(1e-12).to(torch.bfloat16)
        full = _expand(scale.float(), bn, bk, w.shape)
        w_q = (w / full).clamp(-448, 448).to(FP8)
        return {"weight": w_q, "weight_scale_inv": scale}, w_q.float() * full
    if scheme in ("fp8_channel", "fp8_tensor"):
        amax = w.abs().amax(dim=1, keepdim=True) if scheme == "fp8_channel" else w.abs().amax()
        scale = (amax / 448.0).clamp_min(1e-12).float().reshape(-1, 1)
        if scheme == "fp8_tensor":
            scale = scale.reshape(1)
        w_q = (w / scale.reshape(-1, 1)).clamp(-448, 448).to(FP8)
        return {"weight": w_q, "weight_scale": scale}, w_q.float() * scale.reshape(-1, 1)
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )

    group = int(scheme.split("_g")[1])
    groups = w.unflatten(1, (-1, group))
    if "_asym_" in scheme:  # min-max: zp = round(-min / s) - 8, q = round(w / s) + zp
        low, high = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)
        scale = ((high - low) / 15.0).clamp_min(1e-8).to(torch.bfloat16)
        zero = (torch.round(-low / scale.float()) - 8).clamp(-8, 7)
    else:
        scale = (groups.abs().amax(dim=-1) / 7.0).clamp_min(1e-8).to(torch.bfloat16)
        zero = torch.zeros_like(scale, dtype=torch.float32)
    q = torch.round(groups / scale.float()[..., None]) + zero[..., None]
    q = q.clamp(-8, 7).flatten(1).to(torch.int8)
    packed = pack_to_int32(q, 4)
    # The dequantized weight from the library's own unpacking (the format's oracle).
    unpacked = unpack_from_int32(packed, 4, torch.Size(w.shape)).float()
    tensors = {"weight_packed": packed, "weight_scale": scale}
    if "_asym_" in scheme:
        zp_packed = pack_to_int32(zero.to(torch.int8), 4, packed_dim=0)
        zero = unpack_from_int32(zp_packed, 4, torch.Size(scale.shape), packed_dim=0).float()
        tensors["weight_zero_point"] = zp_packed
    shifted = unpacked.unflatten(1, (-1, group)) - zero[..., None]
    deq = (shifted * scale.float()[..., None]).flatten(1)
    tensors["weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int64)
    return tensors, deq


def quantization_config(scheme: str, block=(128, 128)) -> dict:
    if scheme.startswith("awq"):
        return {  # as transformers' AwqConfig writes AutoAWQ's
            "quant_method": "awq", "bits": 4, "group_size": int(scheme.split("_g")[-1]),
            "zero_point": True, "version": "gemm", "modules_to_not_convert": None,
        }  # fmt: skip
    if scheme.startswith("gptq"):
        return {  # as GPTQModel writes it (fields that do not change storage included)
            "quant_method": "gptq", "bits": 4, "group_size": int(scheme.split("_g")[-1]),
            "desc_act": False, "sym": "_asym_" not in scheme, "lm_head": False,
            "damp_percent": 0.01,
            "true_sequential": True, "static_groups": False,
            "checkpoint_format": "gptq_v2" if "_v2_" in scheme else "gptq",
            "meta": {"quantizer": ["gptqmodel:2.2.0"]}, "pack_dtype": "int32",
        }  # fmt: skip
    if scheme == "fp8_block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
            "modules_to_not_convert": KEEP_FLOAT,
        }
    ignore = ["lm_head", "re:.*embed_tokens$", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$"]
    ignore.append("re:.*in_proj_(ba|a|b)$")
    if scheme.startswith("fp8"):
        strategy = "channel" if scheme == "fp8_channel" else "tensor"
        weights = {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "strategy": strategy,
            "dynamic": False,
            "group_size": None,
            "observer": "minmax",
        }
        acts = {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "strategy": "token",
            "dynamic": True,
            "observer": None,
        }
        fmt = "float-quantized"
    else:
        weights = {
            "num_bits": 4,
            "type": "int",
            "symmetric": "_asym_" not in scheme,
            "strategy": "group",
            "group_size": int(scheme.split("_g")[1]),
            "dynamic": False,
            "actorder": None,
            "observer": "minmax",
        }
        acts = None
        fmt = "pack-quantized"
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights,
                        "input_activations": acts, "output_activations": None}
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }  # fmt: skip


def _copy_side_files(src: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, out / path.name)


def _tensors(src: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def write_quantized(
    src: Path, out: Path, scheme: str, block=(128, 128), config_edit=None, pattern=QUANTIZED
):
    """The quantized checkpoint; `config_edit(quantization_config)` may alter the config
    (bad-config tests); `pattern` picks the weights to quantize."""
    _copy_side_files(src, out)
    tensors = {}
    for name, tensor in _tensors(src).items():
        if pattern.search(name) and tensor.dim() == 2:
            parts, _ = quantize_weight(tensor, scheme, block)
            prefix = name[: -len("weight")]
            tensors.update({prefix + suffix: t.contiguous() for suffix, t in parts.items()})
        else:
            tensors[name] = tensor
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    qcfg = quantization_config(scheme, block)
    if config_edit is not None:
        qcfg = config_edit(qcfg)
    config["quantization_config"] = qcfg
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def write_dequantized(
    src: Path, out: Path, scheme: str, block=(128, 128), pattern=QUANTIZED
) -> Path:
    """The float reference: every quantized weight replaced by its dequantized value."""
    _copy_side_files(src, out)
    tensors = {}
    for name, tensor in _tensors(src).items():
        if pattern.search(name) and tensor.dim() == 2:
            tensors[name] = quantize_weight(tensor, scheme, block)[1].to(tensor.dtype)
        else:
            tensors[name] = tensor
    save_file(tensors, str(out / "model.safetensors"))
    shutil.copy(src / "config.json", out / "config.json")
    return out


def fake_quant_fp8_inputs(model: torch.nn.Module, group_size: int | None) -> None:
    """Hooks every quantized nn.Linear of a transformers model so its input is quantized
    to e4m3 and back per token and `group_size` group (None: per token), as the FP8
    kernels quantize activations: the model then computes what the FP8 kernels compute,
    up to float32 rounding."""

    def hook(module, args):
        (x,) = args
        return (_fake_quant(x, group_size).view(x.shape),)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and QUANTIZED.search(name + ".weight"):
            module.register_forward_pre_hook(hook)


def _fake_quant(x: torch.Tensor, group_size: int | None) -> torch.Tensor:
    from kvloom.kernels.fp8_quant import per_token_group_quant_fp8_ref

    flat = x.reshape(-1, x.shape[-1])
    group = group_size or flat.shape[1]
    x_q, x_s = per_token_group_quant_fp8_ref(flat, group)
    return (x_q.float().unflatten(1, (-1, group)) * x_s[..., None]).flatten(1).to(x.dtype)


def fake_quant_fp8_experts(model: torch.nn.Module, group_size: int | None) -> None:
    """The same for transformers' fused expert modules (3-D gate_up_proj / down_proj
    parameters, no nn.Linear to hook): both expert projections see e4m3-rounded inputs."""
    import torch.nn.functional as F

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in torch.unique(top_k_index).tolist():
            token_idx, top_k_pos = torch.where(top_k_index == expert)
            x = _fake_quant(hidden_states[token_idx], group_size)
            gate, up = F.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
            act = _fake_quant(self.act_fn(gate) * up, group_size)
            y = F.linear(act, self.down_proj[expert]) * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    for module in model.modules():
        if type(module).__name__.endswith("Experts") and hasattr(module, "gate_up_proj"):
            module.forward = forward.__get__(module)
