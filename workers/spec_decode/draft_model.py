"""A separate draft model (same tokenizer) proposing tokens on the worker.

Its layers join the target's KV-cache groups in the one block pool (layers with equal
specs share a group's block table, each with its own pages), so the scheduler allocates,
caches and frees them with the request like any other layer. Each step the draft model
(1) runs over the same tokens as the target, keeping its KV in step, then (2) proposes
`k` tokens greedily, one position at a time from the token the target just emitted,
writing its KV into the lookahead slots the scheduler reserved
(`SpeculativeConfig.num_lookahead_slots`, invariant 6). Greedy drafts are deterministic,
so the rejection sampler treats them as one-hot proposals and the output is lossless.

A draft model with linear-attention layers (a hybrid model as its own draft) keeps its
recurrent state exact: it catches up only over the tokens the target accepted, and its state
pages are saved before the proposal steps and restored after them, so no draft ever stays
in the state. When the target itself rolls back (a rejected draft on a hybrid target) the
scheduler's backup/restore covers the draft's linear groups too.

On CUDA the proposal steps replay graphs (`capture_graphs`, proposal_graphs.py). A draft
without linear-state layers also replays its catch-up in a (rows, k + 1) graph when the
step is a uniform verification step (`capture_catch_up_graphs`): it runs over all k + 1
tokens of each row, rejected drafts included, as the target's verification does. KV
written at a rejected position is rewritten by the next proposal at that position
before anything reads it (attention reads positions below a row's length only), so the
result is the eager catch-up's. A draft with linear state catches up eagerly over the
kept tokens only (its state cannot take back a token). The state save/restore around the
proposals stays outside the graphs, as it is around the eager steps.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from kvloom.contracts.kv_cache_spec import LinearStateSpec
from kvloom.kernels.device_copy import to_device
from kvloom.workers.attention_metadata import ForwardBatch, GroupMetadata
from kvloom.workers.cuda_graphs import TargetGraphs
from kvloom.workers.models.registry import model_class
from kvloom.workers.row_kinds import RowClasses, classify_rows
from kvloom.workers.spec_decode.drafter import DraftStep
from kvloom.workers.spec_decode.proposal_graphs import ProposalGraphs
from kvloom.workers.weight_loader import iterate_checkpoint, load_weights

# Draft layers are keyed apart from the target's when the layers are grouped.
DRAFT_LAYER_OFFSET = 1_000_000


class DraftModel:
    def __init__(
        self,
        model_dir: str,
        dtype: torch.dtype,
        tp,
        device,
        target_vocab: int,
        progress: bool = False,
        dummy_seed: int | None = None,
    ):
        """dummy_seed: the target runs `load_format="dummy"` (benchmarks of real shapes),
        so the draft's weights are drawn the same way with this seed (the target's seed:
        a draft of the target's own config then drafts exactly the target's tokens)."""
        config = json.loads((Path(model_dir) / "config.json").read_text())
        config = config.get("text_config") or config
        if int(config["vocab_size"]) != target_vocab:
            raise ValueError(
                f"speculative_config.draft_model: vocab_size {config['vocab_size']} differs "
                f"from the target's {target_vocab}; the draft must share the tokenizer"
            )
        klass = model_class((config.get("architectures") or [""])[0])
        with torch.device(device):
            model = klass(config, dtype, tp)
        if dummy_seed is not None:
            from kvloom.workers.model_runner import fill_dummy_weights

            fill_dummy_weights(model, dummy_seed)
        else:
            load_weights(
                model,
                iterate_checkpoint(Path(model_dir), progress=progress),
                klass.stacked_params,
                klass.ignored_weight_prefixes,
                model.tied,
            )
        self.model = model.eval()
        self.device = device
        self.layer_to_group: dict[int, int] = {}
        self.linear_layers: list = []
        self.graphs: ProposalGraphs | None = None
        self.catch_up_graphs: TargetGraphs | None = None

    def kv_cache_specs(self, block_size: int, dtype_name: str) -> dict[int, object]:
        specs = self.model.kv_cache_specs(block_size, dtype_name)
        self.linear_layers = [
            layer
            for layer in self.model.cache_layers()
            if isinstance(specs[layer.layer_index], LinearStateSpec)
        ]
        return {DRAFT_LAYER_OFFSET + layer: spec for layer, spec in specs.items()}

    def _state_tensors(self) -> list[torch.Tensor]:
        return [
            t for layer in self.linear_layers for t in (layer.conv_state, layer.recurrent_state)
        ]

    def bind_groups(self, layer_to_group: dict[int, int]) -> None:
        self.layer_to_group = {
            key - DRAFT_LAYER_OFFSET: g
            for key, g in layer_to_group.items()
            if key >= DRAFT_LAYER_OFFSET
        }

    def capture_graphs(self, make_graph, sizes, groups, max_model_len, pool=None) -> None:
        """Graphs of one proposal position (proposal_graphs.py): token ids in, draft ids out."""

        def step(batch, input_ids):
            return self.model.compute_logits(self.model(input_ids, batch.positions, batch)).argmax(
                -1
            )

        self.graphs = ProposalGraphs(
            step,
            {"input_ids": (None, torch.long)},
            groups,
            self.layer_to_group,
            self.device,
            sizes,
            max_model_len,
        )
        self.graphs.capture(make_graph, pool)

    def capture_catch_up_graphs(self, make_graph, sizes, groups, max_model_len, k, pool=None):
        """(rows, k + 1) graphs of the catch-up forward (see the module docstring); None
        where the draft has linear state. Returns the memory pool."""
        if self.linear_layers or k < 1:
            return pool
        self.catch_up_graphs = TargetGraphs(
            self.model, groups, self.layer_to_group, self.device, sizes, max_model_len, k + 1
        )
        self.catch_up_graphs.capture(make_graph, pool)
        return self.catch_up_graphs.pool

    def release_graphs(self) -> None:
        self.graphs = None
        self.catch_up_graphs = None

    def catch_up(self, input_ids: torch.Tensor, batch: ForwardBatch, keep: list[int]) -> None:
        """Runs the draft over the first keep[i] tokens of each row of this step (the real
        tokens and the accepted drafts), so its KV and state cover exactly those."""
        input_ids, batch = keep_prefix(input_ids, batch, keep)
        self.model(
            input_ids,
            batch.positions,
            dataclasses.replace(batch, layer_to_group=self.layer_to_group),
        )

    def run(self, step: DraftStep) -> dict[str, list[int]]:
        size = step.verification_graph_size(self.catch_up_graphs)
        if size is not None:  # every token of the verification, rejected drafts included
            self.catch_up_graphs.replay(size, step.input_ids, step.batch)
        else:
            self.catch_up(step.input_ids, step.batch, step.kept_tokens())
        starts = step.starts()
        proposals = self.propose(starts, step.k, step.slots_fn, step.groups)
        return {rid: p for (rid, _, _, _), p in zip(starts, proposals)}

    def propose(self, starts, k: int, slots_fn, groups) -> list[list[int]]:
        """starts: per row (request id, block ids per group, position of the token just
        emitted, that token). Returns k greedy draft tokens per row."""
        if not starts:
            return []
        # Each position's drafts feed the next on the device: the host builds position
        # s + 1's batch while position s runs, and reads all k drafts back once.
        tokens = to_device([token for _, _, _, token in starts], torch.long, self.device)
        drafts = []
        # Proposal steps advance the draft's linear state over drafts: save it, restore after.
        pages = self._live_pages([b for _, b, _, _ in starts], groups)
        saved = [(t, t[pages].clone()) for t in self._state_tensors()] if pages is not None else []
        for step in range(k):
            positions = [pos + step for _, _, pos, _ in starts]
            batch = single_token_batch(
                [b for _, b, _, _ in starts],
                positions,
                slots_fn,
                groups,
                self.layer_to_group,
                self.device,
            )
            drafted = None
            if self.graphs is not None:
                drafted = self.graphs.run(batch, input_ids=tokens)
            if drafted is None:
                hidden = self.model(tokens, batch.positions, batch)
                drafted = self.model.compute_logits(hidden).argmax(dim=-1)
            tokens = drafted.clone()  # a graph's output buffer is rewritten by its next replay
            drafts.append(tokens)
        for tensor, values in saved:
            tensor[pages] = values
        return torch.stack(drafts, dim=1).tolist()

    def _live_pages(self, block_ids, groups) -> torch.Tensor | None:
        linear = [
            g
            for g, grp in enumerate(groups)
            if isinstance(grp.spec, LinearStateSpec)
            and any(self.layer_to_group.get(layer.layer_index) == g for layer in self.linear_layers)
        ]
        if not linear:
            return None
        return to_device([ids[g][0] for ids in block_ids for g in linear], torch.long, self.device)


def single_token_batch(
    block_ids, positions, slots_fn, groups, layer_to_group, device
) -> ForwardBatch:
    """One decode token per row at `positions` (a drafter's proposal step)."""
    dev = device
    n = len(positions)
    metas = []
    for g, group in enumerate(groups):
        rows = [ids[g] for ids in block_ids]
        width = max(len(r) for r in rows)
        table = to_device([r + [0] * (width - len(r)) for r in rows], torch.int32, dev)
        state_indices = None
        if isinstance(group.spec, LinearStateSpec):
            slots = []  # state lives in one page per request
            state_indices = to_device([r[0] for r in rows], torch.long, dev)
        else:
            slots = [
                s
                for r, p in zip(rows, positions)
                for s in slots_fn(r, group.spec.block_size, p, p + 1)
            ]
        metas.append(GroupMetadata(table, to_device(slots, torch.long, dev), state_indices))
    return ForwardBatch(
        positions=to_device(positions, torch.long, dev),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
        seq_lens=to_device([p + 1 for p in positions], torch.int32, dev),
        num_computed_tokens=to_device(positions, torch.int32, dev),
        query_start_loc_list=list(range(n + 1)),
        seq_lens_list=[p + 1 for p in positions],
        rows=RowClasses(classify_rows(positions, [1] * n), [1] * n),
        groups=metas,
        layer_to_group=layer_to_group,
    )


def computed_tokens(batch: ForwardBatch) -> list[int]:
    """Each row's tokens computed before this step, from the host's lists (no readback)."""
    qsl = batch.query_start_loc_list
    return [seq - (qsl[i + 1] - qsl[i]) for i, seq in enumerate(batch.seq_lens_list)]


def keep_prefix(input_ids: torch.Tensor, batch: ForwardBatch, keep: list[int]):
    """The batch restricted to the first keep[i] tokens of each row."""
    qsl = batch.query_start_loc_list
    if all(k == qsl[i + 1] - qsl[i] for i, k in enumerate(keep)):
        return input_ids, batch
    index = to_device(
        [t for i, k in enumerate(keep) for t in range(qsl[i], qsl[i] + k)],
        torch.long,
        input_ids.device,
    )
    starts = [0]
    for k in keep:
        starts.append(starts[-1] + k)
    computed = computed_tokens(batch)
    groups = [
        GroupMetadata(
            g.block_tables,
            g.slot_mapping[index] if g.slot_mapping.numel() else g.slot_mapping,
            g.state_indices,
        )
        for g in batch.groups
    ]
    seq_lens = [c + k for c, k in zip(computed, keep)]
    dev = input_ids.device
    return input_ids[index], dataclasses.replace(
        batch,
        positions=batch.positions[index],
        query_start_loc=to_device(starts, torch.int32, dev),
        seq_lens=to_device(seq_lens, torch.int32, dev),
        query_start_loc_list=starts,
        seq_lens_list=seq_lens,
        rows=RowClasses(classify_rows(computed, keep), keep),
        groups=groups,
    )
