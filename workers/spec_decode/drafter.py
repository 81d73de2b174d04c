"""What a worker-side drafter (draft model, EAGLE head) gets after each target step.

Both drafters implement `run(step: DraftStep) -> {request id: draft tokens}`: bring their
own KV/state up to date with the tokens the target kept, then propose `k` tokens for every
request that just sampled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvloom.kernels.device_copy import to_device
from kvloom.workers.attention_metadata import ForwardBatch
from kvloom.workers.cuda_graphs import verify_graph_size_for


@dataclass
class DraftStep:
    request_ids: list[str]  # scheduled rows, in batch order
    input_ids: torch.Tensor
    batch: ForwardBatch
    hidden: torch.Tensor  # the target's hidden state per input token
    drafts: dict[str, list[int]]  # drafts verified this step
    sampled: dict[str, list[int]]  # emitted tokens: accepted drafts + the target's own
    finished: list[str]  # requests the workers forget this step
    block_ids: dict[str, list[list[int]]]  # per request, per KV-cache group
    num_tokens: dict[str, int]  # per request: its tokens before this step's emitted ones
    slots_fn: Callable
    groups: list
    k: int
    # Rows that did not sample (a prefill chunk short of the prompt's end): the token
    # after the chunk. Heads that book a token beside the previous position's hidden
    # state (EAGLE-3) need it to complete the chunk's last entry in the same step.
    next_tokens: dict[str, int] = field(default_factory=dict)

    def kept_tokens(self) -> list[int]:
        """Per row: the tokens whose results stand (real tokens and accepted drafts)."""
        qsl = self.batch.query_start_loc_list
        kept = []
        for i, rid in enumerate(self.request_ids):
            n = qsl[i + 1] - qsl[i]
            if rid in self.sampled:  # rejected drafts do not stand
                n -= len(self.drafts.get(rid, [])) - (len(self.sampled[rid]) - 1)
            kept.append(n)
        return kept

    def verification_graph_size(self, graphs) -> int | None:
        """The row count of a drafter's (rows, k + 1) catch-up graph (`graphs`, StepGraphs
        or None) to replay for this step, or None: only a uniform verification step, every
        row resuming with its k drafts, as the target's own verification graphs."""
        if graphs is None:
            return None
        drafts = [len(self.drafts.get(rid, [])) for rid in self.request_ids]
        tokens = self.input_ids.shape[0]
        return verify_graph_size_for(self.batch.rows, drafts, self.k, tokens, graphs.sizes)

    def verification_entries(self) -> tuple[torch.Tensor, list[int]]:
        """A uniform verification step's entries for a head that books token x_{p+1}
        beside the target's state at p (MTP, EAGLE-3), over every token of every row:
        (ids, per row the index of its last kept entry, which takes the token just
        sampled). Entries past it pair rejected drafts; their KV is rewritten by the
        proposal at that position before any read."""
        q = self.k + 1
        n = len(self.request_ids)
        kept = self.kept_tokens()
        shifted = [i * q + min(j + 1, q - 1) for i in range(n) for j in range(q)]
        last = [i * q + kept[i] - 1 for i in range(n)]
        dev = self.input_ids.device
        ids = self.input_ids[to_device(shifted, torch.long, dev)]
        following = [self.sampled[rid][-1] for rid in self.request_ids]
        ids[to_device(last, torch.long, dev)] = to_device(following, ids.dtype, dev)
        return ids, last

    def starts(self) -> list[tuple[str, list[list[int]], int, int]]:
        """Per sampled request: (id, block ids, position of its newest token, that token)."""
        return [
            (rid, self.block_ids[rid], self.num_tokens[rid] + len(emitted) - 1, emitted[-1])
            for rid, emitted in self.sampled.items()
        ]
