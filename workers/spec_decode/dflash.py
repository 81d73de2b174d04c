"""The `dflash` drafter: published DFlash block drafters (z-lab's DFlashDraftModel).

The format, as z-lab/dflash (dflash/model.py) defines it and vLLM's qwen3_dflash.py loads
it: a Qwen3-style config with

    dflash_config.target_layer_ids   target layers whose outputs condition the draft
    dflash_config.mask_token_id      the token filling the block's undrafted slots
    dflash_config.block_size         (or top-level block_size, default 16) trained block
    layer_types / sliding_window     per-layer sliding windows (all sliding in seed 002)
    is_causal / dflash_config.causal attention inside the block (default: causal on
                                     sliding layers only, vLLM's and z-lab's rule)

and tensors fc.weight [H, n·H] (n target layers), hidden_norm.weight, norm.weight and
`layers.<i>.*` Qwen3 decoder layers (q/k norms); the target's embedding and LM head are
shared (an own `lm_head.weight` with `d2t` / `embed_tokens.weight` are read if present).

How it drafts: the target's hidden states at the target layers (layer t's output, the
residual stream entering layer t + 1; Hugging Face's hidden_states[t + 1], whose last
entry is the final normed state) are concatenated, fused by fc and normed by
hidden_norm into one context vector per token. Every draft layer projects that vector to
its keys and values at the token's position; they are written into the drafter's KV pages
in the target's KV-cache groups for exactly the tokens the target kept, so prefix hits
carry them. To propose k tokens after the target emitted token x_b at position b, one
forward runs the block [x_b, mask × k] at positions b..b+k: its queries attend to the
cached context (positions < b) and to the block's own keys (computed in the forward,
never cached), and the LM head's argmax at positions b+1..b+k are the drafts.

All-sliding drafters report SlidingWindowSpec layers; the planner books them as full
attention while prefix caching is on (invariant 4), and the window is still applied here.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kvloom.kernels.device_copy import to_device
from kvloom.kernels.merge_attention_states import merge_attention_states_ref
from kvloom.kernels.ops import paged_attention, write_kv_cache
from kvloom.kernels.paged_attention import compute_dtype
from kvloom.workers.attention_metadata import GroupMetadata
from kvloom.workers.layers.linear import ReplicatedLinear
from kvloom.workers.layers.norm import RMSNorm
from kvloom.workers.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from kvloom.workers.models.llama import STACKED_PARAMS, LlamaDecoderLayer, head_dim_of
from kvloom.workers.spec_decode.aux_hidden import AuxHiddenCapture
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

ARCHITECTURE = "DFlashDraftModel"
FIELD = "speculative_config.model (dflash)"
VOCAB_MAPS = {"d2t", "t2d"}


@dataclasses.dataclass
class DFlashFormat:
    hidden: int
    vocab: int
    draft_vocab: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int
    windows: list[int | None]  # per layer
    causal: list[bool]  # per layer
    embedding_scale: float


def _value(config: dict, name: str, default=None):
    """A DFlash setting: under dflash_config, else top level (z-lab's lookup)."""
    return (config.get("dflash_config") or {}).get(name, config.get(name, default))


def layer_attention(config: dict, index: int, where: str) -> tuple[int | None, bool]:
    """(sliding window, causal) of draft layer `index`, by vLLM's rule for the published
    checkpoints: `layer_types` decides sliding (dflash_config.use_swa forces it); an
    explicit is_causal or dflash_config.causal decides causality, else sliding layers are
    causal and full ones attend to the whole block."""
    dflash = config.get("dflash_config") or {}
    types = config.get("layer_types")
    any_sliding = bool(types) and "sliding_attention" in types
    if types is None or (dflash.get("use_swa") and not any_sliding):
        sliding = bool(dflash.get("use_swa", False))
    else:
        sliding = types[index] == "sliding_attention"
    window = None
    if sliding:
        window = dflash.get("swa_window_size", config.get("sliding_window"))
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"{where}: sliding layers need a sliding_window, got {window!r}")
    causal = config.get("is_causal")
    if causal is None:
        causal = dflash.get("causal")
    if causal is None:
        causal = sliding
    return window, bool(causal)


def check_dflash_config(config: dict, target_config: dict, k: int, where: str) -> DFlashFormat:
    arch = (config.get("architectures") or [None])[0]
    if arch != ARCHITECTURE:
        raise ValueError(
            f"{where}: architectures {arch!r} is not a DFlash drafter ({ARCHITECTURE}); "
            "DFlash2DraftModel (candidate selector, dynamic convolutions) is not supported"
        )
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{where}: config {key} must be a positive int, got {value!r}")
    hidden, target_hidden = config["hidden_size"], target_config["hidden_size"]
    if hidden != target_hidden:
        raise ValueError(
            f"{where}: hidden_size {hidden} does not match the target's hidden_size "
            f"{target_hidden} (the drafter reads the target's embeddings and hidden states)"
        )
    vocab = target_config["vocab_size"]
    if config.get("vocab_size", vocab) != vocab:
        raise ValueError(
            f"{where}: vocab_size {config['vocab_size']} differs from the target's {vocab}"
        )
    draft_vocab = config.get("draft_vocab_size") or vocab
    ids = _value(config, "target_layer_ids")
    depth = target_config["num_hidden_layers"]
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise ValueError(
            f"{where}: dflash_config.target_layer_ids must list layer ids, got {ids!r}"
        )
    if any(not 0 <= i < depth for i in ids):
        raise ValueError(
            f"{where}: dflash_config.target_layer_ids {ids} names layers outside the "
            f"target's 0..{depth - 1}"
        )
    mask = _value(config, "mask_token_id")
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < vocab:
        raise ValueError(
            f"{where}: dflash_config.mask_token_id must be a token id below {vocab}, got {mask!r}"
        )
    block = _value(config, "block_size", 16)
    if isinstance(block, bool) or not isinstance(block, int) or block < 2:
        raise ValueError(f"{where}: dflash_config.block_size must be an int >= 2, got {block!r}")
    if k > block - 1:
        raise ValueError(
            f"speculative_config.num_speculative_tokens {k} exceeds what the DFlash drafter "
            f"at {where} proposes per block (block_size {block} - 1)"
        )
    for key in ("attention_sink_bias", "use_attn_res"):
        if _value(config, key):
            raise ValueError(f"{where}: {key} is not supported")
    if config.get("is_neox_style") is False:
        raise ValueError(f"{where}: is_neox_style false (interleaved rope) is not supported")
    attention = [layer_attention(config, i, where) for i in range(config["num_hidden_layers"])]
    return DFlashFormat(
        hidden,
        vocab,
        draft_vocab,
        list(ids),
        mask,
        block,
        [w for w, _ in attention],
        [c for _, c in attention],
        float(_value(config, "input_embedding_scale", 1.0)),
    )


def dflash_tensor_shapes(config: dict, fmt: DFlashFormat):
    """(tensors the format requires, tensors it may carry) with their shapes."""
    h, heads = fmt.hidden, config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    hd, inter = head_dim_of(config), config["intermediate_size"]
    expected = {
        "fc.weight": (h, len(fmt.target_layer_ids) * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        attn = {"q": heads * hd, "k": kv * hd, "v": kv * hd}
        for name, rows in attn.items():
            expected[f"{p}self_attn.{name}_proj.weight"] = (rows, h)
        expected[f"{p}self_attn.o_proj.weight"] = (h, heads * hd)
        if config.get("attention_bias"):
            for name, rows in {**attn, "o": h}.items():
                expected[f"{p}self_attn.{name}_proj.bias"] = (rows,)
        expected[f"{p}self_attn.q_norm.weight"] = (hd,)
        expected[f"{p}self_attn.k_norm.weight"] = (hd,)
        expected[f"{p}input_layernorm.weight"] = (h,)
        expected[f"{p}post_attention_layernorm.weight"] = (h,)
        expected[f"{p}mlp.gate_proj.weight"] = (inter, h)
        expected[f"{p}mlp.up_proj.weight"] = (inter, h)
        expected[f"{p}mlp.down_proj.weight"] = (h, inter)
    optional = {
        "embed_tokens.weight": (fmt.vocab, h),
        "lm_head.weight": (fmt.draft_vocab, h),
        "d2t": (fmt.draft_vocab,),
        "t2d": (fmt.vocab,),
    }
    if fmt.draft_vocab < fmt.vocab:
        for name in ("lm_head.weight", "d2t"):
            expected[name] = optional.pop(name)
    return expected, optional


def block_attention(q, k, v, scale, window, causal):
    """Attention of each row's block queries over its own block keys.
    q: [R, n, Hq, D], k/v: [R, n, Hkv, D] -> (out [R·n, Hq, D], lse [R·n, Hq])."""
    acc = compute_dtype(q.dtype)
    group = q.shape[2] // k.shape[2]
    k = k.to(acc).repeat_interleave(group, dim=2)
    v = v.to(acc).repeat_interleave(group, dim=2)
    scores = torch.einsum("rqhd,rkhd->rhqk", q.to(acc), k) * scale
    n = q.shape[1]
    pos = torch.arange(n, device=q.device)
    visible = torch.ones(n, n, dtype=torch.bool, device=q.device)
    if causal:
        visible &= pos[None, :] <= pos[:, None]
    if window is not None:
        visible &= (pos[:, None] - pos[None, :]).abs() < window
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [R, H, n]
    out = torch.einsum("rhqk,rkhd->rqhd", torch.softmax(scores, dim=-1), v)
    return out.flatten(0, 1), lse.transpose(1, 2).flatten(0, 1)


class DFlashLayer(nn.Module):
    """A Qwen3 decoder layer (its weights and names) with DFlash's attention."""

    def __init__(self, config: dict, index: int, window, causal: bool, tp, dtype):
        super().__init__()
        layer = LlamaDecoderLayer(config, index, tp, dtype, qk_norm=True)
        self.self_attn, self.mlp = layer.self_attn, layer.mlp
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.self_attn.attn.sliding_window = window
        self.causal = causal

    @property
    def attn(self):
        return self.self_attn.attn

    def keys_values(self, x, positions):
        a = self.self_attn
        q, k, v = a.qkv_proj.split(a.qkv_proj(x))
        q = q.view(q.shape[0], -1, a.head_dim)
        k = k.view(k.shape[0], -1, a.head_dim)
        q, k = a.rotary.norm_and_rotate(positions, q, k, a.q_norm, a.k_norm)
        return q, k, v.reshape(k.shape)

    def write_context(self, context, positions, slot_mapping) -> None:
        """Caches the keys and values of the fused target states at their positions."""
        _, k, v = self.keys_values(context, positions)
        write_kv_cache(k, v, self.attn.kv_cache, slot_mapping, self.attn.k_scale, self.attn.v_scale)

    def forward(self, positions, hidden, residual, blocks: BlockRows):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        q, k, v = self.keys_values(hidden, positions)
        out = self.attend(q, k, v, blocks)
        hidden, residual = self.post_attention_layernorm(self.self_attn.o_proj(out), residual)
        return self.mlp(hidden), residual

    def attend(self, q, k, v, blocks: BlockRows) -> torch.Tensor:
        """Cached context (positions < b, through the paged kernel) merged by log-sum-exp
        with the block's own keys."""
        attn, n = self.attn, blocks.size
        meta = blocks.groups[blocks.layer_to_group[attn.layer_index]]
        window, rows = attn.sliding_window, blocks.num_rows
        heads = q.shape[1]
        lse_dtype = torch.promote_types(compute_dtype(q.dtype), torch.float32)
        context_out = q.new_zeros(rows, n, heads, q.shape[2])
        context_lse = torch.full((rows, n, heads), float("-inf"), dtype=lse_dtype, device=q.device)
        qb = q.view(rows, n, heads, -1)
        # Query j sits at b + j; the kernel sees each as one token at b - 1 over the
        # context, so its window shrinks by j + 1 to reach back exactly as far (one
        # launch per j), unless no row's context reaches past the window at all.
        if window is None or blocks.max_context + n <= window:
            spans = [(range(n), None)]
        else:
            spans = [([j], window - j - 1) for j in range(n)]
        for js, w in spans:
            if w is not None and w < 1:
                continue  # the window ends inside the block: no context key is visible
            js = list(js)
            qj = qb[:, js].flatten(0, 1)
            count = qj.shape[0]
            out, lse = paged_attention(
                qj,
                attn.kv_cache,
                meta.block_tables.repeat_interleave(len(js), dim=0),
                torch.arange(count + 1, dtype=torch.int32, device=q.device),
                blocks.context_lens.repeat_interleave(len(js)),
                attn.scale,
                w,
                max_query_len=1,
                k_scale=attn.k_scale,
                v_scale=attn.v_scale,
            )
            context_out[:, js] = out.view(rows, len(js), heads, -1).to(q.dtype)
            context_lse[:, js] = lse.view(rows, len(js), heads).to(lse_dtype)
        kb, vb = k.view(rows, n, k.shape[1], -1), v.view(rows, n, k.shape[1], -1)
        own_out, own_lse = block_attention(qb, kb, vb, attn.scale, window, self.causal)
        merged, _ = merge_attention_states_ref(
            torch.stack([context_out.flatten(0, 1), own_out.to(q.dtype)]),
            torch.stack([context_lse.flatten(0, 1), own_lse.to(lse_dtype)]),
        )
        return merged.flatten(1)


@dataclasses.dataclass
class BlockRows:
    """The proposal forward's layout: `num_rows` blocks of `size` tokens; row r's
    context is its first context_lens[r] positions, cached in its block tables."""

    num_rows: int
    size: int
    context_lens: torch.Tensor  # [rows] int32
    max_context: int  # the largest of them (host side)
    groups: list  # GroupMetadata per KV-cache group (block tables used)
    layer_to_group: dict[int, int]


class DFlashHead(nn.Module):
    def __init__(self, config: dict, fmt: DFlashFormat, own: set[str], tp, dtype):
        super().__init__()
        config = {**config, "model_type": "qwen3", "layer_types": None, "sliding_window": None}
        h, eps = fmt.hidden, config.get("rms_norm_eps", 1e-6)
        self.fc = ReplicatedLinear(len(fmt.target_layer_ids) * h, h, dtype=dtype)
        self.hidden_norm = RMSNorm(h, eps, dtype)
        self.layers = nn.ModuleList(
            DFlashLayer(config, i, fmt.windows[i], fmt.causal[i], tp, dtype)
            for i in range(config["num_hidden_layers"])
        )
        self.norm = RMSNorm(h, eps, dtype)
        self.embed_tokens = (
            VocabParallelEmbedding(fmt.vocab, h, tp, dtype)
            if "embed_tokens.weight" in own
            else None
        )
        self.lm_head = (
            ParallelLMHead(fmt.draft_vocab, h, tp, dtype) if "lm_head.weight" in own else None
        )

    def cache_layers(self):
        return [layer.attn for layer in self.layers]

    def context(self, aux: list[torch.Tensor]) -> torch.Tensor:
        return self.hidden_norm(self.fc(torch.cat(aux, dim=-1)))

    def forward(self, embeds, positions, blocks: BlockRows) -> torch.Tensor:
        hidden, residual = embeds, None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, blocks)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DFlashProposer:
    def __init__(self, spec, target, dtype, tp, device, progress: bool = False):
        head_dir = spec.model
        where = f"{FIELD} {head_dir}"
        if target is None:  # the drafter actor passes its parts (target_parts.py)
            raise ValueError(
                "speculative_config.method 'dflash' needs the target model: its config, "
                "embedding and LM head"
            )
        config = read_config(head_dir, FIELD)
        fmt = check_dflash_config(config, target.config, spec.num_speculative_tokens, where)
        found = tensor_shapes(head_dir)
        expected, optional = dflash_tensor_shapes(config, fmt)
        check_tensors(found, expected, optional, where)
        own = set(found)
        maps = load_named(head_dir, VOCAB_MAPS)
        targets = None
        if "lm_head.weight" in own:
            targets = draft_to_target_ids(
                maps.get("d2t"), maps.get("t2d"), fmt.draft_vocab, fmt.vocab, where
            ).to(device)
        with torch.device(device):
            head = DFlashHead(config, fmt, own, tp, dtype)
        load_weights(head, iterate_except(head_dir, VOCAB_MAPS, progress), STACKED_PARAMS)
        self.model = head.eval()
        self.format = fmt
        self.target = target
        self.device = device
        self.draft_targets = targets
        self.layer_to_group: dict[int, int] = {}
        # Layer t's output is the stream entering layer t + 1; the target's last layer
        # is read after the final norm (Hugging Face's hidden_states[L]).
        depth = target.config["num_hidden_layers"]
        self.points = [t + 1 for t in fmt.target_layer_ids]
        self.capture = AuxHiddenCapture(
            target,
            [p for p in self.points if p < depth],
            f"{where}: dflash_config.target_layer_ids",
        )

    # Its layers join the target's KV-cache groups as an EAGLE head's do.
    kv_cache_specs = EagleProposer.kv_cache_specs
    bind_groups = EagleProposer.bind_groups

    def run(self, step: DraftStep) -> dict[str, list[int]]:
        self.write_context(step)
        starts = step.starts()
        if not starts:
            return {}
        drafts = self.propose(starts, step.k, step.groups).tolist()
        return {rid: row for (rid, _, _, _), row in zip(starts, drafts)}

    def _aux_states(self, step: DraftStep) -> list[torch.Tensor]:
        captured = iter(self.capture.take())
        depth = self.target.config["num_hidden_layers"]
        return [step.hidden if p == depth else next(captured) for p in self.points]

    def write_context(self, step: DraftStep) -> None:
        """The kept tokens' context keys and values, into every draft layer's pages."""
        aux = self._aux_states(step)
        kept = step.kept_tokens()
        qsl = step.batch.query_start_loc_list
        index = [t for i, n in enumerate(kept) for t in range(qsl[i], qsl[i] + n)]
        take = to_device(index, torch.long, step.hidden.device)
        context = self.model.context([a[take] for a in aux])
        positions = step.batch.positions[take]
        for layer in self.model.layers:
            meta = step.batch.groups[self.layer_to_group[layer.attn.layer_index]]
            layer.write_context(context, positions, meta.slot_mapping[take])

    def propose(self, starts, k: int, groups) -> torch.Tensor:
        """One forward over [x_b, mask × k] per row -> [rows, k] draft tokens."""
        fmt, dev, n = self.format, self.device, k + 1
        ids = to_device(
            [t for _, _, _, token in starts for t in [token] + [fmt.mask_token_id] * k],
            torch.long,
            dev,
        )
        positions = to_device([b + j for _, _, b, _ in starts for j in range(n)], torch.long, dev)
        metas = []
        for g in range(len(groups)):
            rows = [blocks[g] for _, blocks, _, _ in starts]
            width = max(len(r) for r in rows)
            table = [r + [0] * (width - len(r)) for r in rows]
            tables = to_device(table, torch.int32, dev)
            metas.append(GroupMetadata(tables, torch.empty(0, dtype=torch.long, device=dev)))
        lens = [b for _, _, b, _ in starts]
        blocks = BlockRows(
            len(starts),
            n,
            to_device(lens, torch.int32, dev),
            max(lens),
            metas,
            self.layer_to_group,
        )
        embed = self.model.embed_tokens
        if embed is None:
            embed = self.target.model.embed_tokens
        embeds = embed(ids) * fmt.embedding_scale
        hidden = self.model(embeds, positions, blocks).view(len(starts), n, -1)[:, 1:]
        return self.draft_ids(hidden.flatten(0, 1)).view(len(starts), k)

    def draft_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy; output_multiplier and final_logit_softcapping (z-lab's logit
        transforms) are monotone, so they leave the argmax alone and are not applied."""
        if self.model.lm_head is None:
            return self.target.compute_logits(hidden).argmax(dim=-1)
        return self.draft_targets[self.model.lm_head.compute_logits(hidden).argmax(dim=-1)]


def write_dflash_head(
    out_dir,
    target_dir,
    target_layer_ids: list[int] | None = None,
    num_layers: int = 2,
    block_size: int = 8,
    mask_token_id: int = 4,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    seed: int = 0,
    overrides: dict[str, torch.Tensor | None] | None = None,
):
    """A random-weight DFlash drafter in the published layout for the target at
    `target_dir` (tests, benchmarks). `overrides` replaces tensors by name (None drops)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    target = json.loads((Path(target_dir) / "config.json").read_text())
    target = target.get("text_config") or target
    hidden = target["hidden_size"]
    heads = target["num_attention_heads"]
    depth = target["num_hidden_layers"]
    ids = target_layer_ids if target_layer_ids is not None else list(range(min(depth, 3)))
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": target.get("max_position_embeddings", 4096),
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "vocab_size": target["vocab_size"],
        "tie_word_embeddings": False,
        "block_size": block_size,
        "num_target_layers": depth,
        "dflash_config": {"target_layer_ids": ids, "mask_token_id": mask_token_id},
    }
    if layer_types is not None:
        config["layer_types"] = layer_types
        config["sliding_window"] = sliding_window
        config["use_sliding_window"] = sliding_window is not None
    if is_causal is not None:
        config["is_causal"] = is_causal
    fmt = check_dflash_config(config, target, 1, str(out_dir))
    expected, _ = dflash_tensor_shapes(config, fmt)
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        name: 1 + 0.1 * torch.randn(shape, generator=gen)
        if len(shape) == 1
        else 0.2 * torch.randn(shape, generator=gen)
        for name, shape in expected.items()
    }
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
