"""The state pages of a linear-attention layer (Gated DeltaNet, KDA).

A run of consecutive blocks of the one pool holds, per layer, a causal-conv window and a
recurrent state: a request's live state, or a prefix-cache checkpoint of it. A state is
indexed by the pool block id of its run's first page.
"""

from __future__ import annotations

import torch

from kvloom.workers.cache_pages import span_view
from kvloom.workers.dtypes import TORCH_DTYPES


class LinearStatePages:
    conv_state: torch.Tensor | None = None
    recurrent_state: torch.Tensor | None = None

    def allocate_cache(self, pages: torch.Tensor, spec) -> None:
        """Views the pool's pages: the conv window first, the recurrent state after it. A
        state larger than a page runs on over the next pages (`span_view`): the pool hands
        state groups runs of `spec.pages_per_state` consecutive pages."""
        self.conv_state = span_view(pages, TORCH_DTYPES[spec.dtype], spec.conv_state_shape)
        self.recurrent_state = span_view(
            pages, TORCH_DTYPES[spec.state_dtype], spec.recurrent_state_shape, spec.conv_bytes
        )

    def release_cache(self) -> None:
        """Drops the pages (the model runner re-allocates after its profiling run)."""
        self.conv_state = None
        self.recurrent_state = None

    def poison_cache(self, block_ids: torch.Tensor) -> None:
        self.conv_state[block_ids] = float("nan")
        self.recurrent_state[block_ids] = float("nan")

    def copy_cache(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """State checkpoints (prefix caching): page src[i] -> page dst[i]."""
        self.conv_state[dst] = self.conv_state[src]
        self.recurrent_state[dst] = self.recurrent_state[src]
