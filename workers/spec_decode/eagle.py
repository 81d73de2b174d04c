"""A hidden-state drafter (EAGLE-style head) fed the target's hidden states.

The head sees, at position t, the token embedding of x_t (the target's embedding table)
next to the target's hidden state at t-1, fused by `fc` into one vector that a few
Llama-style decoder layers turn into a hidden state; the target's norm and LM head turn that
into logits. Proposals are greedy and autoregressive: after the first, each step feeds the
head's own hidden state where the target's would be.

Its attention layers join the target's KV-cache groups in the one pool (like a draft model).
A head whose layers are all sliding-window (as the seeds' DFlash drafter is) is booked as
full attention for prefix caching while the window is still enforced at compute
(invariant 4), so its cache hits line up with the target's.

The target's hidden state at position t-1 is needed when position t is computed, also
across steps: it is kept per request for the last few positions. When it is missing (a
prefix-cache hit or a resumed request starts at t > 0), zeros stand in: drafts may then be
worse, never wrong — the target verifies every draft. What is kept is a copy: the
target's hidden states may be a CUDA graph's static output, which the next replay
overwrites.

On CUDA the greedy proposal positions replay graphs (`capture_graphs`,
proposal_graphs.py), for EAGLE and the heads built on this loop (EAGLE-3, MTP); the
catch-up forward stays eager.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from kvloom.contracts.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec
from kvloom.kernels.device_copy import to_device
from kvloom.workers.attention_metadata import ForwardBatch
from kvloom.workers.cuda_graphs import StaticBatch, StepGraphs
from kvloom.workers.layers.linear import ReplicatedLinear
from kvloom.workers.layers.norm import RMSNorm
from kvloom.workers.models.llama import LlamaDecoderLayer
from kvloom.workers.spec_decode.draft_model import (
    DRAFT_LAYER_OFFSET,
    computed_tokens,
    single_token_batch,
)
from kvloom.workers.spec_decode.drafter import DraftStep
from kvloom.workers.spec_decode.proposal_graphs import ProposalGraphs
from kvloom.workers.weight_loader import iterate_checkpoint, load_weights

ARCHITECTURE = "KvloomEagleHead"
HISTORY = 64  # target hidden states kept per request (positions)


class EagleHead(nn.Module):
    stacked_params = [
        ("qkv_proj", "q_proj", 0),
        ("qkv_proj", "k_proj", 1),
        ("qkv_proj", "v_proj", 2),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, config: dict, dtype: torch.dtype, tp=None):
        super().__init__()
        hidden = config["hidden_size"]
        self.fc = ReplicatedLinear(2 * hidden, hidden, dtype=dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, tp, dtype, qk_norm=False)
            for i in range(config["num_hidden_layers"])
        )
        self.norm = RMSNorm(hidden, config.get("rms_norm_eps", 1e-6), dtype)

    def cache_layers(self):
        return [layer.self_attn.attn for layer in self.layers]

    def forward(self, embeds, prev_hidden, positions, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.fc(torch.cat([embeds, prev_hidden], dim=-1))
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class EagleProposer:
    # Proposal graphs, once captured (heads built on this class set up their own state).
    graphs: ProposalGraphs | None = None
    # (rows, k + 1) catch-up graphs over every verification entry, for heads that book
    # token x_{p+1} beside a target state at p (MTP, EAGLE-3: `capture_entry_graphs`).
    catch_up_graphs: StepGraphs | None = None

    def __init__(self, head_dir: str, target, dtype, tp, device, progress: bool = False):
        config = json.loads((Path(head_dir) / "config.json").read_text())
        if (config.get("architectures") or [None])[0] != ARCHITECTURE:
            raise ValueError(
                f"speculative_config.draft_model: {head_dir} is not a {ARCHITECTURE} checkpoint"
            )
        target_hidden = target.config["hidden_size"]
        if config["hidden_size"] != target_hidden:
            raise ValueError(
                f"speculative_config.draft_model: head hidden_size {config['hidden_size']} "
                f"differs from the target's {target_hidden}"
            )
        with torch.device(device):
            head = EagleHead(config, dtype, tp)
        load_weights(
            head, iterate_checkpoint(Path(head_dir), progress=progress), EagleHead.stacked_params
        )
        self.model = head.eval()
        self.config = config
        self.target = target
        self.device = device
        self.layer_to_group: dict[int, int] = {}
        self.history: dict[str, dict[int, torch.Tensor]] = {}

    def kv_cache_specs(self, block_size: int, dtype_name: str) -> dict[int, object]:
        specs = {}
        for attn in self.model.cache_layers():
            args = (block_size, attn.num_kv_heads, attn.head_size, dtype_name)
            spec = (
                SlidingWindowSpec(*args, sliding_window=attn.sliding_window)
                if attn.sliding_window
                else FullAttentionSpec(*args)
            )
            specs[DRAFT_LAYER_OFFSET + attn.layer_index] = spec
        return specs

    def bind_groups(self, layer_to_group: dict[int, int]) -> None:
        self.layer_to_group = {
            key - DRAFT_LAYER_OFFSET: g
            for key, g in layer_to_group.items()
            if key >= DRAFT_LAYER_OFFSET
        }

    def run(self, step: DraftStep) -> dict[str, list[int]]:
        self.forget(step.finished)
        qsl = step.batch.query_start_loc_list
        computed = computed_tokens(step.batch)
        spans = [(rid, computed[i], qsl[i], qsl[i + 1]) for i, rid in enumerate(step.request_ids)]
        self.catch_up(step.input_ids, step.batch, step.hidden, spans)
        kept = step.kept_tokens()
        self.remember(spans, step.hidden, {rid: kept[i] for i, rid in enumerate(step.request_ids)})
        starts = step.starts()
        proposals = self.propose(starts, step.k, step.slots_fn, step.groups)
        return {rid: p for (rid, _, _, _), p in zip(starts, proposals)}

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self.history.pop(rid, None)

    def _prev_hidden(self, rid: str, position: int) -> torch.Tensor:
        found = self.history.get(rid, {}).get(position - 1)
        if found is None:
            return torch.zeros(
                self.config["hidden_size"], dtype=self.model.fc.weight.dtype, device=self.device
            )
        return found

    def catch_up(self, input_ids, batch: ForwardBatch, hidden, row_spans) -> None:
        """row_spans: per row (request id, first position, token index range) of this step.
        Runs the head over the step's tokens (its KV follows the target's) and records the
        target's hidden states for the next steps."""
        prev = []
        for rid, start, lo, hi in row_spans:
            prev.append(self._prev_hidden(rid, start)[None])
            if hi - lo > 1:
                prev.append(hidden[lo : hi - 1])
        embeds = self.embed(input_ids)
        self.model(
            embeds,
            torch.cat(prev).to(embeds.dtype),
            batch.positions,
            dataclasses.replace(batch, layer_to_group=self.layer_to_group),
        )

    def remember(self, row_spans, hidden, kept: dict[str, int]) -> None:
        """Keeps the target's hidden states of this step's real and accepted positions,
        copied out in one gather (`hidden` may be a graph's static output)."""
        index = [lo + i for rid, _, lo, _ in row_spans for i in range(kept[rid])]
        copied = hidden[to_device(index, torch.long, hidden.device)]
        at = 0
        for rid, start, _, _ in row_spans:
            keep = kept[rid]
            store = self.history.setdefault(rid, {})
            for i in range(keep):
                store[start + i] = copied[at + i]
            at += keep
            for old in [p for p in store if p < start + keep - HISTORY]:
                del store[old]

    def propose(self, starts, k: int, slots_fn, groups) -> list[list[int]]:
        """starts: per row (request id, block ids per group, position of the token just
        emitted, that token). Returns k greedy draft tokens per row."""
        if not starts:
            return []
        prev = torch.stack([self._prev_hidden(rid, pos) for rid, _, pos, _ in starts])
        return self.greedy_steps(starts, [t for _, _, _, t in starts], prev, k, slots_fn, groups)

    def propose_from(self, step: DraftStep, lm_state, next_state, last: dict[str, int]):
        """Drafts for each sampled row of `step` from a head's output at the row's last
        entry (`last`: request id -> entry index): the first from `lm_state` through the
        LM head, k - 1 greedy steps fed `next_state` (MTP: the same state; EAGLE-3: the
        pre-norm one)."""
        starts = step.starts()
        rows = to_device([last[rid] for rid, _, _, _ in starts], torch.long, lm_state.device)
        first = self.draft_ids(lm_state[rows])
        drafts = self.greedy_steps(
            starts,
            first,
            next_state[rows],
            step.k - 1,
            step.slots_fn,
            step.groups,
            include_first=True,
        )
        return {rid: d for (rid, _, _, _), d in zip(starts, drafts)}

    def greedy_steps(
        self, starts, tokens, prev, steps: int, slots_fn, groups, include_first: bool = False
    ) -> list[list[int]]:
        """`steps` greedy proposals per row of `starts`: step s feeds the row's token (the
        given one, then its own drafts) beside `prev` (then the head's own state) at the
        row's position + s, writing the head's KV into the lookahead slots there."""
        if not isinstance(tokens, torch.Tensor):
            tokens = to_device(tokens, torch.long, self.device)
        ids = tokens
        # Chained on the device and read back once (as DraftModel.propose); include_first:
        # the given tokens are themselves drafts (a head's first position), returned first.
        drafts = [tokens] if include_first else []
        for step in range(steps):
            positions = [pos + step for _, _, pos, _ in starts]
            batch = single_token_batch(
                [b for _, b, _, _ in starts],
                positions,
                slots_fn,
                groups,
                self.layer_to_group,
                self.device,
            )
            out = None
            if self.graphs is not None:
                out = self.graphs.run(batch, ids=ids, prev=prev)
            if out is None:
                out = self._proposal_step(batch, ids, prev)
            drafted, prev = out
            ids = drafted.clone()  # a graph's output buffer is rewritten by its next replay
            drafts.append(ids)
        if not drafts:
            return [[] for _ in starts]
        return torch.stack(drafts, dim=1).tolist()

    def _proposal_step(self, batch, ids, prev) -> tuple[torch.Tensor, torch.Tensor]:
        """One greedy position: (draft ids, the state fed to the next position)."""
        embeds = self.embed(ids)
        hidden, nxt = self.head_step(embeds, prev.to(embeds.dtype), batch.positions, batch)
        return self.draft_ids(hidden), nxt

    def capture_graphs(self, make_graph, sizes, groups, max_model_len, pool=None) -> None:
        """Graphs of one greedy position (proposal_graphs.py). The state fed between
        positions has the embedding's width and dtype in every head built on this loop."""
        probe = self.embed(torch.zeros(1, dtype=torch.long, device=self.device))
        self.graphs = ProposalGraphs(
            self._proposal_step,
            {"ids": (None, torch.long), "prev": (probe.shape[-1], probe.dtype)},
            groups,
            self.layer_to_group,
            self.device,
            sizes,
            max_model_len,
        )
        self.graphs.capture(make_graph, pool)

    def release_graphs(self) -> None:
        self.graphs = None
        self.catch_up_graphs = None

    def capture_entry_graphs(
        self, make_graph, sizes, groups, max_model_len, k, state: tuple[str, int, object], pool
    ):
        """Captures `catch_up_graphs`: `self._entries(batch, ids, **{name: [tokens, width]})`
        over a uniform verification step's every entry (DraftStep.verification_entries).
        state: (input name, width, dtype) of the target state the head reads. Returns the
        memory pool."""
        q, rows = k + 1, sizes[-1]
        static = StaticBatch(groups, self.layer_to_group, self.device, rows, q, max_model_len)
        name, width, dtype = state
        inputs = {
            "ids": torch.zeros(rows * q, dtype=torch.long, device=self.device),
            name: torch.zeros(rows * q, width, dtype=dtype, device=self.device),
        }
        self.catch_up_graphs = StepGraphs(self._entries, inputs, static, sizes)
        self.catch_up_graphs.capture(make_graph, pool)
        return self.catch_up_graphs.pool

    # What a head format changes (EAGLE-3 overrides all three): ---------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target.model.embed_tokens(ids)

    def head_step(self, embeds, prev, positions, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(the state the next token is read from, the state fed to the next step)."""
        hidden = self.model(embeds, prev, positions, batch)
        return hidden, hidden

    def draft_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden).argmax(dim=-1)


def write_eagle_head(
    out_dir: str | Path,
    target_dir: str | Path,
    num_layers: int = 1,
    sliding_window: int | None = None,
    seed: int = 0,
) -> Path:
    """A random-weight EAGLE-style head for the target at `target_dir` (tests, benchmarks)."""
    from safetensors.torch import save_file

    target = json.loads((Path(target_dir) / "config.json").read_text())
    target = target.get("text_config") or target
    hidden = target["hidden_size"]
    heads = target["num_attention_heads"]
    kv_heads = target.get("num_key_value_heads") or heads
    head_dim = target.get("head_dim") or hidden // heads
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "kvloom_eagle_head",
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": 2 * hidden,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": target.get("max_position_embeddings", 4096),
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "sliding_window": sliding_window,
        "vocab_size": target["vocab_size"],
    }
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.1

    tensors = {"fc.weight": rand(hidden, 2 * hidden), "norm.weight": torch.ones(hidden)}
    for i in range(num_layers):
        p = f"layers.{i}."
        tensors.update(
            {
                p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
                p + "mlp.gate_proj.weight": rand(2 * hidden, hidden),
                p + "mlp.up_proj.weight": rand(2 * hidden, hidden),
                p + "mlp.down_proj.weight": rand(hidden, 2 * hidden),
                p + "input_layernorm.weight": torch.ones(hidden),
                p + "post_attention_layernorm.weight": torch.ones(hidden),
            }
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out
