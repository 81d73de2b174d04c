"""Token sampling: penalties, temperature, min-p, top-k, top-p, seeded draws, logprobs.

Randomness is keyed by (request seed, output position), not by a stream shared across
the batch, so a seeded request draws the same tokens whatever else is batched with it
and after a preemption recomputes it. Sampling is the exponential race: argmax(p / E)
with E ~ Exp(1) picks token i with probability p_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvloom.contracts.sampling_params import SamplingParams
from kvloom.kernels.device_copy import to_device
from kvloom.kernels.ops import apply_token_bitmask_, greedy_argmax

_MIX = 0x9E3779B97F4A7C15


@dataclass
class RowSamplingState:
    params: SamplingParams
    seed: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Output index of the token sampled now, when it differs from len(output_token_ids):
    # the histories are left empty when no penalty reads them (cheap), and a step
    # scheduled ahead may not know its previous token yet.
    num_output_tokens: int | None = None
    # The last output token when it is still on the device (a step scheduled ahead):
    # penalties count it from there, so the host never waits for it.
    pending_token: torch.Tensor | None = None
    # Structured outputs: the allowed next tokens (SchedulerOutput.grammar_bitmasks).
    token_bitmask: bytes | None = None

    @property
    def output_position(self) -> int:
        if self.num_output_tokens is None:
            return len(self.output_token_ids)
        return self.num_output_tokens


def draw_key(seed: int, position: int) -> int:
    return (seed * _MIX + position * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


def apply_penalties(logits: torch.Tensor, rows: list[RowSamplingState]) -> None:
    """In place, without waiting for the device (index lists are copied over pinned)."""
    device, vocab = logits.device, logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        pending = [] if row.pending_token is None else [row.pending_token.view(1)]
        if p.repetition_penalty != 1.0:
            seen_host = sorted(set(row.prompt_token_ids) | set(row.output_token_ids))
            seen = torch.cat([to_device(seen_host, torch.long, device), *pending])
            vals = logits[i, seen]
            # A token listed twice (the pending one may repeat) gets the same value twice.
            logits[i, seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if (p.presence_penalty or p.frequency_penalty) and (row.output_token_ids or pending):
            ids = torch.cat([to_device(row.output_token_ids, torch.long, device), *pending])
            counts = torch.zeros(vocab, dtype=logits.dtype, device=device)
            counts.index_add_(0, ids, torch.ones(ids.shape, dtype=logits.dtype, device=device))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if row.output_position < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(p.eos_token_ids))
            if banned:
                logits[i, to_device(banned, torch.long, device)] = float("-inf")


class _StagingSlot:
    """Pinned host buffers, their device twins, and the event after the last copy."""

    def __init__(self, num_words: int, num_rows: int, device: torch.device) -> None:
        self.host_words = torch.empty(num_words, dtype=torch.int32, pin_memory=True)
        self.host_rows = torch.empty(num_rows, dtype=torch.long, pin_memory=True)
        self.words = torch.empty(num_words, dtype=torch.int32, device=device)
        self.rows = torch.empty(num_rows, dtype=torch.long, device=device)
        self.copied: torch.cuda.Event | None = None

    def fits(self, num_words: int, num_rows: int) -> bool:
        return self.host_words.numel() >= num_words and self.host_rows.numel() >= num_rows


class BitmaskStaging:
    """A step's token bitmasks and the logits rows they mask, staged in pinned host buffers
    kept from step to step and copied to device buffers without waiting (grown when a step
    needs more). Slots take turns, so a step staged while the previous one still runs
    (async scheduling) never waits for it: a step stages at most twice (plain rows, then
    draft lanes), and a slot is rewritten only once the copy out of it two steps back has
    finished (an event, long done by then)."""

    SLOTS = 4

    def __init__(self) -> None:
        self._slots: dict[torch.device, list[_StagingSlot | None]] = {}
        self._turn = 0

    def stage(
        self, masks: list[bytes], rows: list[int], words: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 words [M, words], int64 rows [M]) on `device`; `masks` holds M masks of
        `words` words in all (a row's lanes may sit in one bytes object)."""
        if device.type != "cuda":
            joined = bytearray(b"".join(masks))
            host = torch.frombuffer(joined, dtype=torch.int32).view(len(rows), words)
            return host.to(device), torch.tensor(rows, dtype=torch.long, device=device)
        n, m = sum(map(len, masks)) // 4, len(rows)
        if n != m * words:
            raise ValueError(f"masks: {n} words for {m} rows of {words} words")
        slots = self._slots.setdefault(device, [None] * self.SLOTS)
        self._turn = (self._turn + 1) % self.SLOTS
        slot = slots[self._turn]
        if slot is not None and slot.copied is not None:
            slot.copied.synchronize()  # its host buffers are free again
        if slot is None or not slot.fits(n, m):
            old = (0, 0) if slot is None else (slot.host_words.numel(), slot.host_rows.numel())
            slot = _StagingSlot(max(n, 2 * old[0]), max(m, 2 * old[1]), device)
            slots[self._turn] = slot
        # Each mask straight into the pinned buffer through its bytes view: measured on
        # the CPU at 256 rows of Qwen's vocabulary, 0.2 ms, where joining the masks and a
        # torch copy took 6 ms (and showed as 11.6 ms per step on the H200).
        dst = memoryview(slot.host_words.numpy()).cast("B")
        offset = 0
        for mask in masks:
            dst[offset : offset + len(mask)] = mask
            offset += len(mask)
        slot.host_rows.numpy()[:m] = rows
        slot.words[:n].copy_(slot.host_words[:n], non_blocking=True)
        slot.rows[:m].copy_(slot.host_rows[:m], non_blocking=True)
        slot.copied = torch.cuda.Event()
        slot.copied.record()
        return slot.words[:n].view(m, words), slot.rows[:m]


_STAGING = BitmaskStaging()


def apply_token_bitmasks(logits: torch.Tensor, rows: list[RowSamplingState]) -> None:
    """In place: -inf at every token a row's grammar disallows (rows without a mask are
    left alone). The masked rows' words go over in one non-blocking copy from a pinned
    buffer; one kernel launch masks them (kernels/token_bitmask*.py). Nothing at all when
    no row has a mask."""
    masked = [i for i, row in enumerate(rows) if row.token_bitmask is not None]
    if not masked:
        return
    masks = [rows[i].token_bitmask for i in masked]
    words = len(masks[0]) // 4  # the grammar's vocabulary; tokens past it are disallowed
    bitmask, index = _STAGING.stage(masks, masked, words, logits.device)
    apply_token_bitmask_(logits, bitmask, index)


def apply_lane_bitmasks(logits: torch.Tensor, rows: list[RowSamplingState]) -> None:
    """In place, for draft verification: logits [R, K+1, V]; a row's mask holds one mask per
    lane it samples (its drafts + 1), the lanes after them are padding and left alone.
    All rows' lanes in one copy and one launch, as apply_token_bitmasks."""
    num_rows, lanes, vocab = logits.shape
    if not logits.is_contiguous():
        raise ValueError("logits: lane bitmasks are applied to contiguous logits in place")
    words = (vocab + 31) // 32
    mask_bytes = 4 * words
    masks: list[bytes] = []
    index: list[int] = []
    for i, row in enumerate(rows):
        if row.token_bitmask is None:
            continue
        count = len(row.token_bitmask) // mask_bytes
        masks.append(row.token_bitmask)
        index.extend(i * lanes + lane for lane in range(count))
    if not masks:
        return
    bitmask, index_t = _STAGING.stage(masks, index, words, logits.device)
    apply_token_bitmask_(logits.view(num_rows * lanes, vocab), bitmask, index_t)


def filter_probs(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Zeroes tokens outside min-p, top-k and top-p (one row); never empties the row."""
    if min_p > 0:
        probs = torch.where(probs >= min_p * probs.max(), probs, torch.zeros_like(probs))
    if top_k > 0 and top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(0)
        # Keep a token if the mass before it is < top_p (the first token always stays).
        keep_sorted = (cumulative - sorted_probs) < top_p * cumulative[-1]
        keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs


def sanitize_logits(logits: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns NaN-free logits and the poisoned-lane mask [R, K+1] (real lanes only).
    Padding lanes are sanitised too (so no NaN reaches any op) but never decide anything."""
    nan = logits.isnan()
    pos_inf = logits == float("inf")
    has_pos_inf = pos_inf.any(-1, keepdim=True)
    clean = logits.masked_fill(nan, float("-inf"))
    # The softmax limit of a +inf logit: the +inf entries share all the mass.
    clean = torch.where(has_pos_inf, torch.where(pos_inf, 0.0, float("-inf")), clean)
    empty = (clean == float("-inf")).all(-1, keepdim=True)
    # Nothing selectable: token 0 by convention (a one-hot), so every path below agrees.
    token0 = torch.full(clean.shape[-1:], float("-inf"), device=clean.device)
    token0[:1].fill_(0.0)  # a fill kernel; `token0[0] = 0.0` would wait for the device
    clean = torch.where(empty, token0, clean)
    poisoned = (nan.any(-1) | has_pos_inf[..., 0] | empty[..., 0]) & real
    return clean, poisoned


def race(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(w / E) picks i with probability w_i / sum(w); zero-weight entries never win."""
    score = torch.where(weights > 0, weights / noise, -1.0)
    return score.argmax(-1)


def sample_on_device(
    logits: torch.Tensor, rows: list[RowSamplingState], max_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sampled ids [rows] on the logits' device, and the raw log-probabilities when any
    row asks for them. No host sync for greedy and seeded rows alike: a row's keyed noise
    is drawn on the host and copied over, so the step can be read back later."""
    penalised = any(r.params.reads_token_history or r.params.min_tokens for r in rows)
    constrained = any(r.token_bitmask is not None for r in rows)
    if max_logprobs < 0 and not (penalised or constrained) and all(r.params.greedy for r in rows):
        # One fused pass over the logits, same rules as below (NaN never wins, first +inf,
        # token 0 when nothing is selectable): no float copy, no [rows, vocab] temporaries.
        return greedy_argmax(logits), None
    if max_logprobs < 0 and not penalised and all(r.params.greedy for r in rows):
        # Greedy under grammars: the mask on a copy, then the same fused argmax (its rules
        # are sanitize-then-argmax's), no float copy or sanitizing temporaries.
        masked = logits.clone()
        apply_token_bitmasks(masked, rows)
        return greedy_argmax(masked), None
    raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if max_logprobs >= 0 else None
    logits = logits.float()
    if penalised or constrained:
        logits = logits.clone()
    if penalised:
        apply_penalties(logits, rows)
    # Raw logprobs above are the model's own; the grammar only narrows what is sampled.
    apply_token_bitmasks(logits, rows)
    # Invariant 5: no NaN reaches an argmax (same rules as the rejection sampler, so a row
    # draws the same token with or without speculation, NaN or not).
    logits, _ = sanitize_logits(
        logits, torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    )
    tokens = logits.argmax(-1)
    for i, row in enumerate(rows):
        p = row.params
        if p.greedy:
            continue
        probs = torch.softmax(logits[i] / p.temperature, dim=-1)
        probs = filter_probs(probs, p.top_k, p.top_p, p.min_p)
        gen = torch.Generator(device="cpu").manual_seed(draw_key(row.seed, row.output_position))
        noise = torch.empty(probs.shape[0], dtype=torch.float32).exponential_(generator=gen)
        tokens[i] = race(probs, to_device(noise, torch.float32, probs.device))
    return tokens, raw_logprobs


def finish_sampling(
    tokens: list[int], raw_logprobs: torch.Tensor | None, rows: list[RowSamplingState] | None
) -> list:
    """Per row, logprob info if asked (reads the device: call once the ids are back).
    Without raw logprobs no row has any, and `rows` may be None (a plain greedy step)."""
    if raw_logprobs is None:
        return [None] * len(tokens)
    infos: list = []
    for i, row in enumerate(rows):
        n = row.params.logprobs
        if n is None or raw_logprobs is None:
            infos.append(None)
            continue
        infos.append(logprob_info(raw_logprobs[i], tokens[i], n))
    return infos


def sample(
    logits: torch.Tensor, rows: list[RowSamplingState], max_logprobs: int
) -> tuple[list[int], list[tuple[float, int, list[tuple[int, float]]] | None]]:
    """logits: [rows, vocab] float. Returns sampled ids and, per row, logprob info if asked."""
    tokens, raw_logprobs = sample_on_device(logits, rows, max_logprobs)
    ids = tokens.tolist()
    return ids, finish_sampling(ids, raw_logprobs, rows)


def logprob_info(logprobs: torch.Tensor, token: int, top_n: int):
    """(sampled token's logprob, its rank (1 = most likely), [(id, logprob)] of the top N)."""
    chosen = float(logprobs[token])
    rank = int((logprobs > logprobs[token]).sum()) + 1
    top = []
    if top_n > 0:
        values, ids = torch.topk(logprobs, min(top_n, logprobs.shape[0]))
        top = [(int(t), float(v)) for t, v in zip(ids, values)]
    return chosen, rank, top


def logprob_infos(logits: torch.Tensor, tokens: list[int], top_n: int) -> list:
    """Logprob info for tokens emitted at consecutive positions with these raw logits."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return [logprob_info(lp, t, top_n) for lp, t in zip(logprobs, tokens)]
