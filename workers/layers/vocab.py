"""Vocabulary-parallel embedding and LM head: each rank holds a slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.kernels.dispatch import batch_invariant
from kvloom.workers.layers.linear import check_shape
from kvloom.workers.layers.tp_group import LocalGroup, TPGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self, vocab_size: int, hidden_size: int, tp: TPGroup | None = None, dtype=torch.float32
    ):
        super().__init__()
        self.tp = tp or LocalGroup()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        # Pad so every rank holds an equal slice; padded rows are never looked up.
        per_rank = -(-vocab_size // self.tp.world_size)
        self.start = self.tp.rank * per_rank
        self.end = min(vocab_size, self.start + per_rank)
        self.weight = nn.Parameter(torch.zeros(per_rank, hidden_size, dtype=dtype), False)

    def load_shard(self, param_name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        check_shape(param_name, loaded, (self.vocab_size, self.hidden_size))
        self.weight.data[: self.end - self.start].copy_(loaded[self.start : self.end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = (input_ids >= self.start) & (input_ids < self.end)
        out = F.embedding(torch.where(local, input_ids - self.start, 0), self.weight)
        out = torch.where(local[:, None], out, torch.zeros_like(out))
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits = h W^T over this rank's vocab slice, gathered to the full vocabulary."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if batch_invariant():  # the deterministic mode's fixed-tile GEMM
            from kvloom.kernels.batch_invariant import linear

            logits = linear(hidden, self.weight)
        else:
            logits = F.linear(hidden, self.weight)
        if self.tp.world_size > 1:
            logits = self.tp.all_gather(logits, dim=-1)
        return logits[:, : self.vocab_size]
