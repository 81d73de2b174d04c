"""A drafter's own, smaller vocabulary and its map onto the target's (EAGLE-3, DFlash).

Published EAGLE-3 heads carry an LM head over `draft_vocab_size` tokens and two tensors:
`d2t` [draft_vocab] int64, the offset from a draft id to its target id (target id =
draft id + d2t[draft id], as vLLM and the EAGLE repository read it), and `t2d`
[target vocab] bool, which target ids the draft vocabulary holds. Greedy drafts are the
draft head's argmax, mapped to target ids.
"""

from __future__ import annotations

import torch


def draft_to_target_ids(
    d2t: torch.Tensor | None,
    t2d: torch.Tensor | None,
    draft_vocab: int,
    target_vocab: int,
    where: str,
) -> torch.Tensor:
    """The target id of every draft id ([draft_vocab] int64), checked against `t2d`.
    Without `d2t` the draft vocabulary must be the target's."""
    if d2t is None:
        if draft_vocab != target_vocab:
            raise ValueError(
                f"{where}: draft_vocab_size {draft_vocab} is smaller than the target's "
                f"vocabulary ({target_vocab}) but the checkpoint has no d2t tensor"
            )
        return torch.arange(draft_vocab)
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise ValueError(f"{where}: d2t must hold integer offsets, got {d2t.dtype}")
    targets = torch.arange(draft_vocab) + d2t.long()
    if targets.min() < 0 or targets.max() >= target_vocab:
        raise ValueError(
            f"{where}: d2t maps draft ids outside the target's vocabulary [0, {target_vocab})"
        )
    if targets.unique().numel() != draft_vocab:
        raise ValueError(f"{where}: d2t maps two draft ids onto one target id")
    if t2d is not None:
        if t2d.dtype != torch.bool:
            raise ValueError(f"{where}: t2d must be a bool mask, got {t2d.dtype}")
        mask = torch.zeros(target_vocab, dtype=torch.bool)
        mask[targets] = True
        if not torch.equal(mask, t2d):
            raise ValueError(f"{where}: t2d does not mark exactly the target ids d2t maps to")
    return targets
