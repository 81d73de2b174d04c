"""A separate draft model (same tokenizer) proposing tokens on the worker.

Its layers join the target's KV-cache groups in the one block pool (layers with equal
specs share a group's block table, each with its own pages), so the scheduler allocates,
caches and frees them with the request like any other layer. Each step the draft model
(1) runs over the same tokens as the target, keeping its KV in step, then (2) proposes
`k` tokens greedily, one position at a time from the token the target just emitted,
writing its KV into the lookahead slots the scheduler reserved
(`SpeculativeConfig.num_lookahead_slots`, invariant 6). Greedy drafts are deterministic,
so the rejection sampler treats them as one-hot proposals and the output is lossless.

Attention-only draft models are supported: a linear-attention drafter would need its
state rolled back over rejected drafts, which is not built yet (the loader says so).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from kvloom.cluster.kv_cache.spec import LinearStateSpec
from kvloom.workers.attention_metadata import ForwardBatch, GroupMetadata
from kvloom.workers.models.registry import model_class
from kvloom.workers.row_kinds import RowClasses, classify_rows
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
    ):
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

    def kv_cache_specs(self, block_size: int, dtype_name: str) -> dict[int, object]:
        specs = self.model.kv_cache_specs(block_size, dtype_name)
        if any(isinstance(s, LinearStateSpec) for s in specs.values()):
            raise ValueError(
                "speculative_config.draft_model: linear-attention draft models are not "
                "supported yet (their state would need rolling back over rejected drafts)"
            )
        return {DRAFT_LAYER_OFFSET + layer: spec for layer, spec in specs.items()}

    def bind_groups(self, layer_to_group: dict[int, int]) -> None:
        self.layer_to_group = {
            key - DRAFT_LAYER_OFFSET: g
            for key, g in layer_to_group.items()
            if key >= DRAFT_LAYER_OFFSET
        }

    def catch_up(self, input_ids: torch.Tensor, batch: ForwardBatch) -> None:
        """Runs the draft over this step's tokens so its KV covers them."""
        self.model(
            input_ids,
            batch.positions,
            dataclasses.replace(batch, layer_to_group=self.layer_to_group),
        )

    def propose(
        self, starts: list[tuple[list[list[int]], int, int]], k: int, slots_fn, groups
    ) -> list[list[int]]:
        """starts: per row (block ids per group, position of the token just emitted, that
        token). Returns k greedy draft tokens per row."""
        if not starts:
            return []
        tokens = [token for _, _, token in starts]
        proposals: list[list[int]] = [[] for _ in starts]
        for step in range(k):
            positions = [pos + step for _, pos, _ in starts]
            batch = single_token_batch(
                [b for b, _, _ in starts],
                positions,
                slots_fn,
                groups,
                self.layer_to_group,
                self.device,
            )
            input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
            hidden = self.model(input_ids, batch.positions, batch)
            tokens = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
            for row, token in enumerate(tokens):
                proposals[row].append(int(token))
        return proposals


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
        table = torch.tensor(
            [r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=dev
        )
        if isinstance(group.spec, LinearStateSpec):
            slots = []  # the target's linear layers; the drafter never reads them
        else:
            slots = [
                s
                for r, p in zip(rows, positions)
                for s in slots_fn(r, group.spec.block_size, p, p + 1)
            ]
        metas.append(GroupMetadata(table, torch.tensor(slots, dtype=torch.long, device=dev)))
    return ForwardBatch(
        positions=torch.tensor(positions, dtype=torch.long, device=dev),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=dev),
        num_computed_tokens=torch.tensor(positions, dtype=torch.int32, device=dev),
        query_start_loc_list=list(range(n + 1)),
        seq_lens_list=[p + 1 for p in positions],
        rows=RowClasses(classify_rows(positions, [1] * n), [1] * n),
        groups=metas,
        layer_to_group=layer_to_group,
    )
