"""The `eagle3` drafter: published EAGLE-3 heads (LlamaForCausalLMEagle3 checkpoints).

The format, as the EAGLE repository trains it and vLLM's llama_eagle3.py / SGLang's
llama_eagle3.py load it (config.json + safetensors, H = hidden_size, T = the target's
hidden size, `target_hidden_size` where the head is narrower):

    fc.weight                                [H, 3T]   fuses three target hidden states
    midlayer.hidden_norm.weight              [H]       norms the fused (or own) state
    midlayer.input_layernorm.weight          [H]       norms the token embedding
    midlayer.self_attn.{q,k,v}_proj.weight   [.., 2H]  attention over embedding ‖ state
    midlayer.self_attn.o_proj.weight, midlayer.post_attention_layernorm.weight,
    midlayer.mlp.{gate,up,down}_proj.weight  a Llama decoder layer otherwise
    norm.weight                              [H]
    lm_head.weight                           [draft_vocab_size, H]
    d2t [draft_vocab_size] int64, t2d [vocab] bool   the draft vocabulary (draft_vocab.py)
    embed_tokens.weight [vocab, H]           optional: else the target's embedding

Config: `draft_vocab_size`, `eagle_aux_hidden_state_layer_ids` (top level or under
`eagle_config`; default (2, L/2, L-3) for an L-layer target), `norm_before_residual`.

Auxiliary states: id j is the target's residual stream entering decoder layer j (hidden +
residual; vLLM's numbering, aux_hidden.py), concatenated in the listed order and fused by
`fc`. The head books each entry at its hidden state's position: position p holds token
x_{p+1} beside the target's fused state at p, as vLLM and the EAGLE repository do, so the
first token has no entry and a prefix hit needs no hidden state from before it. The
layer's residual is the state before `hidden_norm` (after it with `norm_before_residual`);
the final norm's input (the pre-norm sum) is what the next proposal step is fed.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kvloom.kernels.device_copy import to_device
from kvloom.workers.layers.linear import QKVParallelLinear, ReplicatedLinear
from kvloom.workers.layers.norm import RMSNorm
from kvloom.workers.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from kvloom.workers.models.llama import STACKED_PARAMS, LlamaDecoderLayer, head_dim_of
from kvloom.workers.spec_decode.aux_hidden import AuxHiddenCapture
from kvloom.workers.spec_decode.draft_model import keep_prefix
from kvloom.workers.spec_decode.draft_vocab import draft_to_target_ids
from kvloom.workers.spec_decode.drafter import DraftStep
from kvloom.workers.spec_decode.eagle import EagleProposer
from kvloom.workers.spec_decode.head_checkpoint import (
    check_tensors,
    iterate_except,
    load_named,
    read_config,
    tensor_shapes,
)
from kvloom.workers.weight_loader import load_weights

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
FIELD = "speculative_config.model (eagle3)"
VOCAB_MAPS = {"d2t", "t2d"}


@dataclasses.dataclass
class Eagle3Format:
    hidden: int
    target_hidden: int
    vocab: int
    draft_vocab: int
    aux_layer_ids: list[int]


def _require_int(config: dict, key: str, where: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where}: config {key} must be a positive int, got {value!r}")
    return value


def aux_layer_ids(config: dict, num_target_layers: int, where: str) -> list[int]:
    """The three target layers the head reads (vLLM's numbering: the stream entering
    layer j), from the config or the EAGLE-3 default for the target's depth."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    name = "eagle_aux_hidden_state_layer_ids"
    if ids is None:
        n = num_target_layers
        ids = [2, n // 2, n - 3]
        name = f"the default aux layers (2, L/2, L-3) for a {n}-layer target"
    if (
        not isinstance(ids, list)
        or len(ids) != 3
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise ValueError(f"{where}: {name} must be a list of three layer ids, got {ids!r}")
    bad = [i for i in ids if not 0 <= i <= num_target_layers]
    if bad:
        raise ValueError(
            f"{where}: {name} {ids} names layers outside the target's 0..{num_target_layers}"
        )
    return list(ids)


def check_eagle3_config(config: dict, target_config: dict, where: str) -> Eagle3Format:
    arch = (config.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{where}: architectures {arch!r} is not an EAGLE-3 head (one of {ARCHITECTURES})"
        )
    if (config.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        raise ValueError(f"{where}: eagle_config.use_aux_hidden_state false is not supported")
    layers = config.get("num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"{where}: num_hidden_layers {layers!r}: EAGLE-3 heads have one layer")
    hidden = _require_int(config, "hidden_size", where)
    for key in ("intermediate_size", "num_attention_heads", "vocab_size"):
        _require_int(config, key, where)
    vocab = config["vocab_size"]
    if vocab != target_config["vocab_size"]:
        raise ValueError(
            f"{where}: vocab_size {vocab} differs from the target's "
            f"{target_config['vocab_size']}; the head must share the target's tokenizer"
        )
    target_hidden = config.get("target_hidden_size") or hidden
    key = "target_hidden_size" if config.get("target_hidden_size") else "hidden_size"
    if target_hidden != target_config["hidden_size"]:
        raise ValueError(
            f"{where}: {key} {target_hidden} does not match the target's hidden_size "
            f"{target_config['hidden_size']}"
        )
    draft_vocab = config.get("draft_vocab_size") or vocab
    if draft_vocab > vocab:
        raise ValueError(f"{where}: draft_vocab_size {draft_vocab} exceeds vocab_size {vocab}")
    ids = aux_layer_ids(config, target_config["num_hidden_layers"], where)
    return Eagle3Format(hidden, target_hidden, vocab, draft_vocab, ids)


def eagle3_tensor_shapes(config: dict, fmt: Eagle3Format):
    """(tensors the format requires, tensors it may carry) with their shapes."""
    h, heads = fmt.hidden, config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    hd, inter = head_dim_of(config), config["intermediate_size"]
    p = "midlayer."
    expected = {
        "fc.weight": (h, 3 * fmt.target_hidden),
        "norm.weight": (h,),
        "lm_head.weight": (fmt.draft_vocab, h),
        p + "hidden_norm.weight": (h,),
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (heads * hd, 2 * h),
        p + "self_attn.k_proj.weight": (kv * hd, 2 * h),
        p + "self_attn.v_proj.weight": (kv * hd, 2 * h),
        p + "self_attn.o_proj.weight": (h, heads * hd),
        p + "mlp.gate_proj.weight": (inter, h),
        p + "mlp.up_proj.weight": (inter, h),
        p + "mlp.down_proj.weight": (h, inter),
    }
    if config.get("attention_bias"):
        for name, rows in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd), ("o", h)):
            expected[f"{p}self_attn.{name}_proj.bias"] = (rows,)
    maps = {"d2t": (fmt.draft_vocab,), "t2d": (fmt.vocab,)}
    optional = {"embed_tokens.weight": (fmt.vocab, h), "t2d": maps["t2d"]}
    if fmt.draft_vocab < fmt.vocab:
        expected["d2t"] = maps["d2t"]
    else:
        optional["d2t"] = maps["d2t"]
    return expected, optional


class Eagle3Head(nn.Module):
    def __init__(self, config: dict, fmt: Eagle3Format, own_embedding: bool, dtype, tp):
        super().__init__()
        config = {"model_type": "llama", **config}
        h, eps = fmt.hidden, config.get("rms_norm_eps", 1e-6)
        self.fc = ReplicatedLinear(3 * fmt.target_hidden, h, dtype=dtype)
        self.midlayer = LlamaDecoderLayer(config, 0, tp, dtype, qk_norm=False)
        attn = self.midlayer.self_attn
        heads = config["num_attention_heads"]
        attn.qkv_proj = QKVParallelLinear(
            2 * h,
            attn.head_dim,
            heads,
            config.get("num_key_value_heads") or heads,
            bias=bool(config.get("attention_bias", False)),
            tp=tp,
            dtype=dtype,
        )
        self.midlayer.hidden_norm = RMSNorm(h, eps, dtype)
        self.norm = RMSNorm(h, eps, dtype)
        self.lm_head = ParallelLMHead(fmt.draft_vocab, h, tp, dtype)
        self.embed_tokens = (
            VocabParallelEmbedding(fmt.vocab, h, tp, dtype) if own_embedding else None
        )
        self.norm_before_residual = bool(config.get("norm_before_residual", False))

    def cache_layers(self):
        return [self.midlayer.self_attn.attn]

    def forward(self, embeds, hidden, positions, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds: the tokens' embeddings; hidden: the fused target state (or the head's
        own pre-norm state). Returns (normed state for the LM head, pre-norm state)."""
        layer = self.midlayer
        normed = layer.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
        out = layer.self_attn(positions, x, batch)
        out, residual = layer.post_attention_layernorm(out, residual)
        return self.norm(layer.mlp(out), residual)


class Eagle3Proposer(EagleProposer):
    """EAGLE's proposal loop (eagle.py) over a published EAGLE-3 head."""

    def __init__(self, head_dir: str, target, dtype, tp, device, progress: bool = False):
        where = f"{FIELD} {head_dir}"
        if target is None:  # the drafter actor passes its parts (target_parts.py)
            raise ValueError(
                "speculative_config.method 'eagle3' needs the target model: its config, "
                "embedding and LM head"
            )
        config = read_config(head_dir, FIELD)
        fmt = check_eagle3_config(config, target.config, where)
        found = tensor_shapes(head_dir)
        expected, optional = eagle3_tensor_shapes(config, fmt)
        check_tensors(found, expected, optional, where)
        own_embedding = "embed_tokens.weight" in found
        if not own_embedding and fmt.hidden != target.config["hidden_size"]:
            raise ValueError(
                f"{where}: hidden_size {fmt.hidden} differs from the target's "
                f"{target.config['hidden_size']} and the head has no embed_tokens of its own"
            )
        maps = load_named(head_dir, VOCAB_MAPS)
        targets = draft_to_target_ids(
            maps.get("d2t"), maps.get("t2d"), fmt.draft_vocab, fmt.vocab, where
        )
        with torch.device(device):
            head = Eagle3Head(config, fmt, own_embedding, dtype, tp)
        load_weights(head, iterate_except(head_dir, VOCAB_MAPS, progress), STACKED_PARAMS)
        self.model = head.eval()
        self.config = config
        self.format = fmt
        self.target = target
        self.device = device
        self.layer_to_group: dict[int, int] = {}
        self.history: dict[str, dict[int, torch.Tensor]] = {}  # unused: entries need none
        self.draft_targets = targets.to(device)
        self.capture = AuxHiddenCapture(
            target, fmt.aux_layer_ids, f"{where}: eagle_aux_hidden_state_layer_ids"
        )
        self.dtype = dtype

    def capture_catch_up_graphs(self, make_graph, sizes, groups, max_model_len, k, pool=None):
        """The catch-up over every entry of a verification (see `run`) in graphs; the
        auxiliary states come concatenated, as `fc` reads them."""
        state = ("aux", self.model.fc.weight.shape[1], self.dtype)
        return self.capture_entry_graphs(make_graph, sizes, groups, max_model_len, k, state, pool)

    def _entries(self, batch, ids: torch.Tensor, aux: torch.Tensor):
        fused = self.model.fc(aux)
        embeds = self.embed(ids)
        return self.model(embeds, fused.to(embeds.dtype), batch.positions, batch)

    def run(self, step: DraftStep) -> dict[str, list[int]]:
        """One forward over this step's kept tokens (each entry x_{p+1} beside the fused
        target state at p; a row's last entry takes the token just sampled, or the next
        prompt token), whose last entry of each sampled row gives its first draft; then
        k - 1 greedy steps."""
        aux = self.capture.take()
        size = step.verification_graph_size(self.catch_up_graphs)
        if size is not None:  # every entry in one replay
            ids, last = step.verification_entries()
            normed, prenorm = self.catch_up_graphs.replay(
                size, step.batch, ids=ids, aux=torch.cat(aux, dim=-1)
            )
            return self.propose_from(step, normed, prenorm, dict(zip(step.request_ids, last)))
        kept = step.kept_tokens()
        qsl = step.batch.query_start_loc_list
        sampled = step.sampled
        following = []
        for rid in step.request_ids:
            if rid in sampled:
                following.append(sampled[rid][-1])
            elif rid in step.next_tokens:
                following.append(step.next_tokens[rid])
            else:
                raise RuntimeError(f"request {rid}: no token after its prefill chunk")
        index, shifted, ends = [], [], []
        for i, n in enumerate(kept):
            index.extend(range(qsl[i], qsl[i] + n))
            shifted.extend(range(qsl[i] + 1, qsl[i] + n))
            shifted.append(-1)  # the following token, filled in below
            ends.append(len(index) - 1)
        last_index = dict(zip(step.request_ids, ends))
        dev = step.input_ids.device
        take = to_device(index, torch.long, dev)
        ids = step.input_ids[to_device([max(s, 0) for s in shifted], torch.long, dev)]
        ids[to_device(ends, torch.long, dev)] = to_device(following, ids.dtype, dev)
        _, batch = keep_prefix(step.input_ids, step.batch, kept)
        batch = dataclasses.replace(batch, layer_to_group=self.layer_to_group)
        fused = self.model.fc(torch.cat([a[take] for a in aux], dim=-1))
        embeds = self.embed(ids)
        normed, prenorm = self.model(embeds, fused.to(embeds.dtype), batch.positions, batch)
        starts = step.starts()
        if not starts:
            return {}
        return self.propose_from(step, normed, prenorm, last_index)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        own = self.model.embed_tokens
        return own(ids) if own is not None else self.target.model.embed_tokens(ids)

    def head_step(self, embeds, prev, positions, batch):
        return self.model(embeds, prev, positions, batch)

    def draft_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy over the draft vocabulary, mapped to target ids."""
        return self.draft_targets[self.model.lm_head.compute_logits(hidden).argmax(dim=-1)]


def write_eagle3_head(
    out_dir,
    target_dir,
    draft_vocab_size: int | None = None,
    aux_layer_ids: list[int] | None = None,
    own_embedding: bool = False,
    hidden_size: int | None = None,
    seed: int = 0,
    overrides: dict[str, torch.Tensor | None] | None = None,
):
    """A random-weight EAGLE-3 head in the published layout for the target at
    `target_dir` (tests, benchmarks). A smaller draft vocabulary takes every other target
    id (so d2t shifts ids). A `hidden_size` other than the target's with `own_embedding`
    writes `target_hidden_size` (a narrower head); without, the head is a mismatch.
    `overrides` replaces tensors by name (None drops one)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    target = json.loads((Path(target_dir) / "config.json").read_text())
    target = target.get("text_config") or target
    hidden = hidden_size or target["hidden_size"]
    heads = target["num_attention_heads"]
    vocab = target["vocab_size"]
    draft_vocab = draft_vocab_size or vocab
    config = {
        "architectures": [ARCHITECTURES[0]],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": target.get("num_key_value_heads") or heads,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": target.get("max_position_embeddings", 4096),
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "tie_word_embeddings": False,
    }
    if own_embedding and hidden != target["hidden_size"]:
        config["target_hidden_size"] = target["hidden_size"]  # a narrower head
    if aux_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
    fmt = Eagle3Format(hidden, target["hidden_size"], vocab, draft_vocab, [])
    expected, optional = eagle3_tensor_shapes(config, fmt)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected.items():
        if name in VOCAB_MAPS:
            continue
        tensors[name] = (
            1 + 0.1 * torch.randn(shape, generator=gen)
            if len(shape) == 1
            else 0.2 * torch.randn(shape, generator=gen)
        )
    if own_embedding:
        tensors["embed_tokens.weight"] = torch.randn(optional["embed_tokens.weight"], generator=gen)
    if draft_vocab < vocab:
        draft_ids = torch.arange(draft_vocab)
        targets = (draft_ids * 2) % vocab if 2 * draft_vocab <= vocab else draft_ids
        tensors["d2t"] = targets - draft_ids
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[targets] = True
        tensors["t2d"] = t2d
    for name, tensor in (overrides or {}).items():
        if tensor is None:
            tensors.pop(name, None)
        else:
            tensors[name] = tensor
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out
