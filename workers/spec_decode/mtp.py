"""The `mtp` drafter: the multi-token-prediction layer Qwen3-Next and Qwen3.5 checkpoints
ship beside their decoder (`mtp.*` tensors of the target's own checkpoint).

The published format (vLLM's qwen3_next_mtp.py / qwen3_5_mtp.py read the same tensors):

    mtp.pre_fc_norm_embedding.weight [H]   zero-centred RMSNorm of the token embedding
    mtp.pre_fc_norm_hidden.weight    [H]   zero-centred RMSNorm of the target's hidden state
    mtp.fc.weight                    [H, 2H]  over concat(embedding, hidden), no bias
    mtp.layers.<i>.*                 a full-attention decoder layer of the target's kind
                                     (gated attention; MoE + shared expert on MoE models)
    mtp.norm.weight                  [H]   the head's own final norm

and the target's embedding table and LM head, shared. Config: `num_nextn_predict_layers`
(Qwen3-Next) or `mtp_num_hidden_layers` (Qwen3.5's text config). The tensors sit at the
top level in every layout, the multimodal `ForConditionalGeneration` one too (its decoder
is under `model.language_model.`, its MTP layer still under `mtp.`). Experts come
per-expert or as Qwen3.5's 3-D `experts.gate_up_proj` / `experts.down_proj` stacks.

Entries are booked as vLLM books them: position p holds token x_{p+1} beside the
target's (final-norm) hidden state h_p, in the target's KV-cache groups, written in the
step that computes p (the token after a prefill chunk is the next prompt token, after the
last one the token just sampled). So the first token has no entry, no hidden state is
kept across steps, and a prefix hit needs none from before it. Each of the k proposals
reuses the one MTP layer, fed its own output as the next hidden state.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kvloom.kernels.device_copy import to_device
from kvloom.workers.layers.linear import ReplicatedLinear
from kvloom.workers.layers.moe import map_expert_weight, map_shared_expert_weight
from kvloom.workers.models.qwen3_5 import Qwen3_5ForCausalLM
from kvloom.workers.models.qwen3_next import (
    STACKED_PARAMS,
    Qwen3NextForCausalLM,
    is_sparse_layer,
    zero_centred_norm,
)
from kvloom.workers.spec_decode.draft_model import keep_prefix
from kvloom.workers.spec_decode.drafter import DraftStep
from kvloom.workers.spec_decode.eagle import EagleProposer
from kvloom.workers.spec_decode.target_parts import TargetParts
from kvloom.workers.weight_loader import checkpoint_files, load_weights

PREFIX = "mtp."
LAYER_COUNT_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
QWEN3_5_ARCHS = (
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)
MTP_ARCHS = ("Qwen3NextForCausalLM", *QWEN3_5_ARCHS)


def _field(what: str) -> str:
    return f"speculative_config.method 'mtp': {what}"


def layer_is_sparse(architecture: str, config: dict, index: int) -> bool:
    """The target family's rule: Qwen3.5-MoE is sparse everywhere, Qwen3-Next by its
    sparse step (vLLM applies it to the MTP layer's own index, 0)."""
    if architecture in QWEN3_5_ARCHS:
        return bool(config.get("num_experts"))
    return is_sparse_layer(config, index)


def mtp_tensor_shapes(
    architecture: str, config: dict, num_layers: int, fused_experts: bool = False
) -> dict[str, tuple[int, ...]]:
    """Every `mtp.*` tensor a checkpoint of this target holds, with its shape."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    shapes: dict[str, tuple[int, ...]] = {
        "mtp.fc.weight": (hidden, 2 * hidden),
        "mtp.pre_fc_norm_embedding.weight": (hidden,),
        "mtp.pre_fc_norm_hidden.weight": (hidden,),
        "mtp.norm.weight": (hidden,),
    }
    for i in range(num_layers):
        p = f"mtp.layers.{i}."
        attn = {
            "q_proj": (2 * heads * head_dim, hidden),  # query and output gate per head
            "k_proj": (kv_heads * head_dim, hidden),
            "v_proj": (kv_heads * head_dim, hidden),
            "o_proj": (hidden, heads * head_dim),
        }
        for name, shape in attn.items():
            shapes[f"{p}self_attn.{name}.weight"] = shape
            if config.get("attention_bias"):
                shapes[f"{p}self_attn.{name}.bias"] = shape[:1]
        shapes[f"{p}self_attn.q_norm.weight"] = (head_dim,)
        shapes[f"{p}self_attn.k_norm.weight"] = (head_dim,)
        shapes[f"{p}input_layernorm.weight"] = (hidden,)
        shapes[f"{p}post_attention_layernorm.weight"] = (hidden,)
        if layer_is_sparse(architecture, config, i):
            shapes.update(_moe_shapes(config, p + "mlp.", fused_experts))
        else:
            inter = config["intermediate_size"]
            shapes[f"{p}mlp.gate_proj.weight"] = (inter, hidden)
            shapes[f"{p}mlp.up_proj.weight"] = (inter, hidden)
            shapes[f"{p}mlp.down_proj.weight"] = (hidden, inter)
    return shapes


def _moe_shapes(config: dict, p: str, fused: bool) -> dict[str, tuple[int, ...]]:
    hidden, experts = config["hidden_size"], config["num_experts"]
    inter, shared = config["moe_intermediate_size"], config["shared_expert_intermediate_size"]
    shapes = {
        f"{p}gate.weight": (experts, hidden),
        f"{p}shared_expert.gate_proj.weight": (shared, hidden),
        f"{p}shared_expert.up_proj.weight": (shared, hidden),
        f"{p}shared_expert.down_proj.weight": (hidden, shared),
        f"{p}shared_expert_gate.weight": (1, hidden),
    }
    if fused:
        shapes[f"{p}experts.gate_up_proj"] = (experts, 2 * inter, hidden)
        shapes[f"{p}experts.down_proj"] = (experts, hidden, inter)
        return shapes
    for e in range(experts):
        shapes[f"{p}experts.{e}.gate_proj.weight"] = (inter, hidden)
        shapes[f"{p}experts.{e}.up_proj.weight"] = (inter, hidden)
        shapes[f"{p}experts.{e}.down_proj.weight"] = (hidden, inter)
    return shapes


@dataclass
class MtpLayout:
    num_layers: int
    files: list[Path]  # the weight files holding mtp.* tensors (none for dummy weights)


def _mtp_files(model_dir: Path) -> list[Path]:
    """The weight files that can hold mtp.* tensors: by the index where there is one."""
    index = model_dir / "model.safetensors.index.json"
    files = checkpoint_files(model_dir)
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        wanted = {v for k, v in weight_map.items() if k.startswith(PREFIX)}
        files = [f for f in files if f.name in wanted]
    return files


def _mtp_headers(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """mtp.* tensor names and shapes, read from the safetensors headers (no data)."""
    shapes = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if key.startswith(PREFIX):
                    shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def _configured_layers(config: dict) -> tuple[str, int] | None:
    for key in LAYER_COUNT_KEYS:
        if key in config:
            value = config[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(_field(f"config {key} must be a non-negative int, got {value!r}"))
            return key, value
    return None


def check_mtp_checkpoint(model_config) -> MtpLayout:
    """Refuses a target that ships no usable MTP layer, naming what is wrong; else says
    where its tensors are. Reads headers only, so it runs before the target loads."""
    arch, config = model_config.architecture, model_config.text_config
    where = model_config.model
    if arch not in MTP_ARCHS:
        raise ValueError(
            _field(f"MTP layers are read from Qwen3-Next / Qwen3.5 checkpoints; {where} is {arch}")
        )
    configured = _configured_layers(config)
    if model_config.load_format == "dummy":  # benchmarks: one layer of random weights
        return MtpLayout(1, [])
    files = _mtp_files(Path(where))
    found = _mtp_headers(files)
    if configured is not None and configured[1] == 0:
        raise ValueError(_field(f"{where} has no MTP layers ({configured[0]} = 0 in config.json)"))
    if not found:
        said = f" although config.json says {configured[0]} = {configured[1]}" if configured else ""
        raise ValueError(
            _field(
                f"{where} has no MTP weights (no mtp.* tensors{said}); this checkpoint "
                "cannot draft for itself: use another method"
            )
        )
    parts = [n.split(".") for n in found if n.startswith("mtp.layers.")]
    counted = {int(p[2]) for p in parts if len(p) > 3 and p[2].isdigit()}
    num_layers = configured[1] if configured else max(counted, default=-1) + 1
    if num_layers != 1:
        raise ValueError(
            _field(
                f"{where} has {num_layers} MTP layers; kvloom runs exactly one (what "
                "Qwen3-Next and Qwen3.5 ship)"
            )
        )
    fused = "mtp.layers.0.mlp.experts.gate_up_proj" in found
    expected = mtp_tensor_shapes(arch, config, num_layers, fused_experts=fused)
    missing = sorted(set(expected) - set(found))
    if missing:
        shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
        raise ValueError(_field(f"{where} lacks {len(missing)} MTP tensor(s): {shown}"))
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        shown = ", ".join(unexpected[:6]) + (" ..." if len(unexpected) > 6 else "")
        raise ValueError(_field(f"{where} has unexpected MTP tensor(s): {shown}"))
    for name, shape in expected.items():
        if found[name] != shape:
            raise ValueError(
                _field(f"{name} has shape {list(found[name])}, expected {list(shape)}")
            )
    return MtpLayout(num_layers, files)


def iterate_mtp_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                if key.startswith(PREFIX):
                    yield key, f.get_tensor(key)


class MtpHead(nn.Module):
    """norm(embed(x_t)) ‖ norm(h_{t-1}) -> fc -> the MTP decoder layer -> mtp.norm."""

    def __init__(self, config: dict, layer_cls, num_layers: int, tp, dtype: torch.dtype):
        super().__init__()
        hidden = config["hidden_size"]
        self.fc = ReplicatedLinear(2 * hidden, hidden, dtype=dtype)
        self.pre_fc_norm_embedding = zero_centred_norm(hidden, config, dtype)
        self.pre_fc_norm_hidden = zero_centred_norm(hidden, config, dtype)
        self.layers = nn.ModuleList(
            layer_cls(config, i, "full_attention", tp, dtype) for i in range(num_layers)
        )
        self.norm = zero_centred_norm(hidden, config, dtype)

    def cache_layers(self):
        return [layer.cache_layer for layer in self.layers]

    def forward(self, embeds, prev_hidden, positions, batch) -> torch.Tensor:
        fused = torch.cat(
            [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(prev_hidden)], dim=-1
        )
        hidden, residual = self.layers[0](positions, self.fc(fused), None, batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class MtpWeights(nn.Module):
    """Holds the head under `mtp`, so checkpoint names load as they are and errors name
    them; experts load per-expert or from Qwen3.5's 3-D stacks."""

    def __init__(self, head: MtpHead):
        super().__init__()
        self.mtp = head

    def map_weight_name(self, ckpt_name: str):
        # A shared expert folded into the fused MoE loads there (Qwen3NextSparseMoe).
        return map_expert_weight(ckpt_name) or map_shared_expert_weight(
            self, ckpt_name, "shared_expert"
        )

    unpack_weight = staticmethod(Qwen3_5ForCausalLM.unpack_weight)


class MtpProposer(EagleProposer):
    """The target's own MTP head behind EAGLE's proposal loop (eagle.py's greedy steps,
    KV booking and group binding); entries as vLLM books them (see `run`)."""

    def __init__(self, model_config, target, dtype, tp, device, progress: bool = False):
        # The drafter actor's TargetParts names the classes of the target it stands for.
        parts = isinstance(target, TargetParts)
        klass = target.model_class if parts else type(target)
        if not issubclass(klass, Qwen3NextForCausalLM):  # Qwen3.5 subclasses it
            raise ValueError(_field(f"the target {klass.__name__} has no MTP layers"))
        layout = check_mtp_checkpoint(model_config)
        config = target.config
        layer_cls = target.decoder_layer_class if parts else type(target.model.layers[0])
        with torch.device(device):
            head = MtpHead(config, layer_cls, layout.num_layers, tp, dtype)
        weights = MtpWeights(head)
        if model_config.load_format == "dummy":
            from kvloom.workers.model_runner import fill_dummy_weights

            fill_dummy_weights(weights, model_config.seed + 1)
        else:
            load_weights(weights, iterate_mtp_tensors(layout.files), STACKED_PARAMS)
        self.model = head.eval()
        self.config = config
        self.target = target
        self.device = device
        self.layer_to_group: dict[int, int] = {}
        self.history: dict[str, dict[int, torch.Tensor]] = {}  # unused: entries need none
        self.dtype = dtype

    def capture_catch_up_graphs(self, make_graph, sizes, groups, max_model_len, k, pool=None):
        """The catch-up over every entry of a verification (see `run`) in graphs."""
        state = ("hidden", int(self.config["hidden_size"]), self.dtype)
        return self.capture_entry_graphs(make_graph, sizes, groups, max_model_len, k, state, pool)

    def _entries(self, batch, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        embeds = self.embed(ids)
        return self.model(embeds, hidden.to(embeds.dtype), batch.positions, batch)

    def run(self, step: DraftStep) -> dict[str, list[int]]:
        """One forward over the step's kept tokens, entry p being token x_{p+1} beside
        the target's hidden state h_p, booked at position p; a row's last entry takes the
        token just sampled, or the prompt token after its chunk. A sampled row's last
        entry gives its first draft, k - 1 greedy steps the others."""
        kept = step.kept_tokens()
        qsl = step.batch.query_start_loc_list
        size = step.verification_graph_size(self.catch_up_graphs)
        if size is not None:  # every entry in one replay (DraftStep.verification_entries)
            ids, last = step.verification_entries()
            out = self.catch_up_graphs.replay(size, step.batch, ids=ids, hidden=step.hidden)
            return self.propose_from(step, out, out, dict(zip(step.request_ids, last)))
        source, shifted, ends, following, last = [], [], [], [], {}
        for i, rid in enumerate(step.request_ids):
            if rid in step.sampled:
                following.append(step.sampled[rid][-1])
            elif rid in step.next_tokens:
                following.append(step.next_tokens[rid])
            else:
                raise RuntimeError(f"request {rid}: no token after its prefill chunk")
            lo, n = qsl[i], kept[i]
            source.extend(range(lo, lo + n))
            shifted.extend(range(lo + 1, lo + n))
            shifted.append(lo)  # a stand-in, overwritten by the following token
            ends.append(len(source) - 1)
            last[rid] = len(source) - 1
        dev = step.input_ids.device
        ids = step.input_ids[to_device(shifted, torch.long, dev)]
        ids[to_device(ends, torch.long, dev)] = to_device(following, ids.dtype, dev)
        hidden = step.hidden[to_device(source, torch.long, dev)]
        _, batch = keep_prefix(step.input_ids, step.batch, kept)
        batch = dataclasses.replace(batch, layer_to_group=self.layer_to_group)
        embeds = self.embed(ids)
        out = self.model(embeds, hidden.to(embeds.dtype), batch.positions, batch)
        starts = step.starts()
        if not starts:
            return {}
        return self.propose_from(step, out, out, last)


def write_mtp_checkpoint(
    target_dir: str | Path,
    out_dir: str | Path,
    seed: int = 0,
    fused_experts: bool = False,
    std: float = 0.1,
    overrides: dict[str, torch.Tensor] | None = None,
) -> Path:
    """A copy of the Qwen3-Next / Qwen3.5 checkpoint at `target_dir` in `out_dir` with one
    random-weight MTP layer added as the published checkpoints hold it (tests,
    benchmarks): `mtp.*` tensors in their own weight file, listed in the index if there is
    one, and the layer count in config.json (`num_nextn_predict_layers` for Qwen3-Next,
    `mtp_num_hidden_layers` in Qwen3.5's text config). `overrides` replaces tensors by
    name (their shapes are checked when the drafter loads)."""
    import shutil

    from safetensors.torch import save_file

    src, out = Path(target_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if src.resolve() != out.resolve():  # else: add the layer in place
        for f in src.iterdir():
            if f.is_file():
                shutil.copy(f, out / f.name)
    hf_config = json.loads((out / "config.json").read_text())
    arch = (hf_config.get("architectures") or [""])[0]
    text = hf_config.get("text_config") or hf_config
    shapes = mtp_tensor_shapes(arch, text, 1, fused_experts)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if len(shape) == 1:  # zero-centred norms: (1 + w)
            tensors[name] = torch.randn(shape, generator=gen) * 0.1
        else:
            tensors[name] = torch.randn(shape, generator=gen) * std
    tensors.update(overrides or {})
    text["mtp_num_hidden_layers" if arch in QWEN3_5_ARCHS else "num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "mtp.safetensors"))
    index = out / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data.setdefault("weight_map", {}).update({name: "mtp.safetensors" for name in tensors})
        index.write_text(json.dumps(data, indent=2))
    return out
