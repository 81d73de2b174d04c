"""Rejection sampling for speculative decoding over a padded batch of drafted rows.

Row r drafted K_r <= K tokens. `target_logits[r, j]` are the target model's logits for the
token at output position pos_r + j, where pos_r = len(rows[r].output_token_ids): lane j < K_r
verifies draft j and lane K_r is the bonus lane. Lanes past K_r are padding; nothing is read
from them for a decision, and draft ids there may be anything (they are zeroed before any
gather). A row emits its accepted drafts and then one token from the target: 1..K_r+1 tokens.

Greedy rows (temperature 0) accept draft j while it equals the target's argmax and emit the
argmax at the first mismatch or at the bonus lane: the tokens greedy decoding emits without
speculation.

Sampled rows use the distribution p of kvloom's sampler (penalties, temperature, min-p, top-k,
top-p through `apply_penalties` and `filter_probs`) and its keyed noise: lane j draws from a
generator seeded with draw_key(seed, pos_r + j), so a row's tokens do not depend on the batch.
- Deterministic drafter (`draft_probs` None, q = one-hot(draft)): lane j finds the token x the
  plain sampler would draw at that position (the exponential race, argmax p / E) and accepts
  the draft iff it equals x, else emits x. The draft is accepted with probability
  p(draft) = min(1, p/q), and on rejection x follows p restricted to tokens != draft, which is
  normalize(max(0, p - q)): standard rejection sampling, and token for token what sampling
  without speculation draws from the same logits.
- Drafter with probabilities q: draft d is accepted iff u * q(d) < p(d), u uniform from the
  lane's generator after its race noise, i.e. with probability min(1, p(d) / q(d)); on
  rejection the lane emits the race winner of max(0, p - q) (of p if that is all zero). The
  bonus lane emits the race winner of p, the same token the plain sampler would draw.

Invariant 5 (padded lanes never win):
- every argmax runs over NaN-free values, and the race scores vocab entries with zero
  probability below every selectable entry, so neither padding nor a masked token can win;
- draft ids are zeroed on padding lanes and clamped into the vocabulary before any gather; a
  real draft id outside [0, V) has target probability 0 and is rejected.
A real lane is *poisoned* when its target logits hold NaN or +inf, when it has no selectable
token (every logit -inf or NaN), or when its `draft_probs` hold NaN, +-inf or negatives. A
poisoned lane never accepts its draft, so the row stops there, and it emits a token from the
sanitised target: NaN entries are dropped; if any entry is +inf, the +inf entries share all the
mass (the softmax limit); if nothing is selectable, token 0. Such rows are flagged in
`RejectionSampleOutput.invalid` so the caller can log or abort them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvloom.contracts.config import require
from kvloom.kernels.device_copy import to_device
from kvloom.kernels.ops import greedy_argmax
from kvloom.workers.sampler import (
    RowSamplingState,
    apply_penalties,
    draw_key,
    filter_probs,
)
from kvloom.workers.sampler import race as _race
from kvloom.workers.sampler import sanitize_logits as _sanitize

PADDING_TOKEN_ID = -1


@dataclass
class RejectionSampleOutput:
    # [R, K+1]: the accepted drafts, then the bonus/recovered token, then PADDING_TOKEN_ID.
    token_ids: torch.Tensor
    # [R]: drafts accepted per row; row r emitted num_accepted[r] + 1 tokens.
    num_accepted: torch.Tensor
    # [R] bool: a real lane of the row was poisoned (see the module docstring).
    invalid: torch.Tensor

    def tolist(self) -> list[list[int]]:
        # One readback: the accepted count rides in front of each row's tokens.
        rows = torch.cat([self.num_accepted[:, None], self.token_ids], dim=1).tolist()
        return [row[1 : row[0] + 2] for row in rows]


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor | Sequence[int],
    rows: Sequence[RowSamplingState],
    draft_probs: torch.Tensor | None = None,
) -> RejectionSampleOutput:
    """target_logits [R, K+1, V], draft_token_ids [R, K], num_draft_tokens [R] (each 0..K),
    rows: one RowSamplingState per row (params, seed, prompt and output ids so far),
    draft_probs [R, K, V] or None for a deterministic drafter (n-gram, greedy draft model)."""
    num_drafts = _validate(target_logits, draft_token_ids, num_draft_tokens, rows, draft_probs)
    num_rows, num_lanes, vocab = target_logits.shape
    k = num_lanes - 1
    device = target_logits.device
    nd = to_device(num_drafts, torch.long, device)
    lanes = torch.arange(num_lanes, device=device)
    real = lanes[None, :] <= nd[:, None]  # [R, K+1]: draft lanes and the bonus lane
    is_draft = lanes[None, :k] < nd[:, None]  # [R, K]

    drafts = torch.where(is_draft, draft_token_ids.to(device=device, dtype=torch.long), 0)
    in_vocab = (drafts >= 0) & (drafts < vocab)
    drafts = drafts.clamp(0, vocab - 1)  # bounded for every gather below

    if draft_probs is None and all(row.params.greedy and not _has_penalties(row.params)
                                   for row in rows):  # fmt: skip
        # Every row greedy: two passes over the raw logits instead of a float32 copy and
        # its sanitising passes; the same tokens and poisoned lanes (`_greedy_lanes`).
        target_argmax, poisoned = _greedy_lanes(target_logits, real)
        accept = is_draft & in_vocab & ~poisoned[:, :k] & (drafts == target_argmax[:, :k])
        return _emit(accept, drafts, target_argmax, poisoned)

    logits = target_logits.float().clone()
    if any(_has_penalties(row.params) for row in rows):  # reads drafts back: only then
        _apply_penalties_per_lane(logits, rows, drafts.tolist(), in_vocab.tolist(), num_drafts)
    logits, poisoned = _sanitize(logits, real)

    q = None
    if draft_probs is not None:
        q = draft_probs.to(device=device, dtype=torch.float32)
        bad_q = (~torch.isfinite(q) | (q < 0)).any(-1) & is_draft
        poisoned[:, :k] |= bad_q
        q = torch.where((is_draft & ~bad_q)[..., None], q, torch.zeros_like(q))

    # Greedy rows, all lanes at once.
    target_argmax = logits.argmax(-1)  # [R, K+1]; NaN-free after _sanitize
    accept = is_draft & in_vocab & ~poisoned[:, :k] & (drafts == target_argmax[:, :k])
    emit = target_argmax.clone()

    sampled = [r for r, row in enumerate(rows) if not row.params.greedy]
    if sampled:
        accept[sampled] = False
        _verify_sampled_rows(
            sampled, logits, rows, num_drafts, drafts, in_vocab, poisoned, q, accept, emit
        )

    return _emit(accept, drafts, emit, poisoned)


def _emit(accept, drafts, emit, poisoned) -> RejectionSampleOutput:
    """Each row's leading run of accepted drafts, then the lane's emitted token."""
    # accept is False on padding lanes, so the leading run stops at K_r at the latest.
    num_accepted = accept.long().cumprod(1).sum(1)
    lanes = torch.arange(emit.shape[1], device=emit.device)
    draft_lanes = torch.cat([drafts, drafts.new_zeros(drafts.shape[0], 1)], dim=1)
    token_ids = torch.where(lanes[None, :] < num_accepted[:, None], draft_lanes, PADDING_TOKEN_ID)
    token_ids.scatter_(1, num_accepted[:, None], emit.gather(1, num_accepted[:, None]))
    invalid = poisoned.any(-1)  # poisoned lanes are real lanes
    return RejectionSampleOutput(token_ids, num_accepted, invalid)


def _greedy_lanes(target_logits, real) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax [R, K+1], poisoned [R, K+1]) as `_sanitize` then argmax give them: the fused
    NaN-safe greedy kernel picks the same token, and a lane is poisoned exactly when its
    maximum is not finite (max propagates NaN; +inf, or nothing but -inf, is not finite)."""
    num_rows, num_lanes, vocab = target_logits.shape
    argmax = greedy_argmax(target_logits.reshape(-1, vocab)).view(num_rows, num_lanes)
    # The max rounded as `.float()` rounds every entry: rounding is monotonic.
    poisoned = ~torch.isfinite(target_logits.amax(-1).float()) & real
    return argmax, poisoned


def _validate(target_logits, draft_token_ids, num_draft_tokens, rows, draft_probs) -> list[int]:
    require(
        isinstance(target_logits, torch.Tensor)
        and target_logits.dim() == 3
        and target_logits.is_floating_point()
        and target_logits.shape[1] >= 1
        and target_logits.shape[2] >= 1,
        "target_logits",
        "a float tensor [R, K+1, V] with K >= 0 and V >= 1",
        getattr(target_logits, "shape", target_logits),
    )
    num_rows, num_lanes, vocab = target_logits.shape
    k = num_lanes - 1
    require(
        isinstance(draft_token_ids, torch.Tensor)
        and tuple(draft_token_ids.shape) == (num_rows, k)
        and not draft_token_ids.is_floating_point()
        and not draft_token_ids.is_complex(),
        "draft_token_ids",
        f"an integer tensor of shape [R, K] = [{num_rows}, {k}]",
        getattr(draft_token_ids, "shape", draft_token_ids),
    )
    if isinstance(num_draft_tokens, torch.Tensor):
        num_draft_tokens = num_draft_tokens.tolist()
    num_drafts = list(num_draft_tokens)
    require(
        len(num_drafts) == num_rows
        and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= k for n in num_drafts),
        "num_draft_tokens",
        f"{num_rows} integers in [0, {k}]",
        num_drafts,
    )
    require(len(rows) == num_rows, "rows", f"{num_rows} RowSamplingState entries", len(rows))
    if draft_probs is not None:
        require(
            isinstance(draft_probs, torch.Tensor)
            and tuple(draft_probs.shape) == (num_rows, k, vocab)
            and draft_probs.is_floating_point(),
            "draft_probs",
            f"None or a float tensor of shape [R, K, V] = [{num_rows}, {k}, {vocab}]",
            getattr(draft_probs, "shape", draft_probs),
        )
    return num_drafts


def _has_penalties(params) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0
        or params.frequency_penalty != 0
        or params.min_tokens > 0
    )


def _apply_penalties_per_lane(logits, rows, drafts, in_vocab, num_drafts) -> None:
    """Penalises lane j as if drafts 0..j-1 were accepted: the only case in which lane j's
    token is used, and then the history the plain sampler would see at that position."""
    for r, row in enumerate(rows):
        if not _has_penalties(row.params):
            continue
        for j in range(num_drafts[r] + 1):
            # A draft outside the vocabulary is rejected, so later lanes never count.
            history = row.output_token_ids + [t for t, ok in zip(drafts[r][:j], in_vocab[r]) if ok]
            lane_row = RowSamplingState(row.params, row.seed, row.prompt_token_ids, history)
            apply_penalties(logits[r, j : j + 1], [lane_row])


def _target_probs(lane_logits: torch.Tensor, rows: list[RowSamplingState]) -> torch.Tensor:
    """[n, V] sanitised logits of sampled rows -> their sampling distributions, computed row by
    row with the plain sampler's expressions so both draw the same token from the same noise."""
    probs = torch.empty_like(lane_logits)
    for i, row in enumerate(rows):
        p = row.params
        row_probs = torch.softmax(lane_logits[i] / p.temperature, dim=-1)
        probs[i] = filter_probs(row_probs, p.top_k, p.top_p, p.min_p)
    return probs


def _lane_noise(
    keys: list[tuple[int, int]], vocab: int, with_uniform: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exponential race noise [n, V] exactly as the plain sampler draws it for (seed, position),
    and when asked one uniform per lane drawn after it from the same generator."""
    noise = torch.empty(len(keys), vocab, dtype=torch.float32)
    uniform = torch.empty(len(keys), dtype=torch.float32) if with_uniform else None
    for i, (seed, position) in enumerate(keys):
        gen = torch.Generator(device="cpu").manual_seed(draw_key(seed, position))
        noise[i].exponential_(generator=gen)
        if uniform is not None:
            uniform[i] = torch.rand((), generator=gen)
    return noise.to(device), None if uniform is None else uniform.to(device)


def _verify_sampled_rows(
    sampled, logits, rows, num_drafts, drafts, in_vocab, poisoned, q, accept, emit
) -> None:
    """Fills accept/emit for sampled rows, lane by lane, drawing noise only for lanes a row
    reaches (a rejection ends the row)."""
    device = logits.device
    vocab = logits.shape[-1]
    k = logits.shape[1] - 1
    alive = list(sampled)
    for j in range(k + 1):
        here = [r for r in alive if j <= num_drafts[r]]
        if not here:
            return
        idx = to_device(here, torch.long, device)
        lane_rows = [rows[r] for r in here]
        probs = _target_probs(logits[idx, j], lane_rows)
        keys = [(row.seed, len(row.output_token_ids) + j) for row in lane_rows]
        noise, uniform = _lane_noise(keys, vocab, q is not None, device)
        winner = _race(probs, noise)
        if j == k:  # only bonus lanes here
            emit[idx, j] = winner
            return
        drafted = to_device([j < num_drafts[r] for r in here], torch.bool, device)
        d = drafts[idx, j]
        can_accept = drafted & in_vocab[idx, j] & ~poisoned[idx, j]
        if q is None:
            lane_accept = can_accept & (d == winner)
            lane_emit = winner
        else:
            qj = q[idx, j]
            p_d = probs.gather(1, d[:, None])[:, 0]
            q_d = qj.gather(1, d[:, None])[:, 0]
            lane_accept = can_accept & (uniform * q_d < p_d)
            residual = (probs - qj).clamp_min(0.0)
            use_p = ~drafted | poisoned[idx, j] | (residual.sum(-1) <= 0)
            lane_emit = _race(torch.where(use_p[:, None], probs, residual), noise)
        accept[idx, j] = lane_accept
        emit[idx, j] = lane_emit
        alive = [r for r, ok in zip(here, lane_accept.tolist()) if ok]
