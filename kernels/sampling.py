"""Top-k / top-p filtering of logits into probabilities: the pure-torch reference.

Per row, in float32 (float64 stays float64):
1. NaN logits count as -inf, +inf as the largest finite float; a row with no finite logit
   (a padding row) is treated as all-equal, so it comes out uniform, never NaN.
2. Top-k: keep the logits >= the k-th largest (ties at the boundary are all kept, so a
   row may keep more than k). k <= 0 or k >= vocab keeps everything (-1 is the usual
   "disabled").
3. Softmax over the kept logits.
4. Top-p: keep the smallest set of most probable tokens whose cumulative probability
   reaches p: with the probabilities sorted descending, the first index whose cumulative
   sum is >= p gives the threshold t, and every token with probability >= t is kept
   (ties kept). At least one token always stays (p <= 0 keeps the most probable);
   p >= 1 or NaN keeps everything. Kept probabilities are renormalised to sum to 1.

Filtered-out tokens get probability exactly 0.
"""

from __future__ import annotations

import torch

from kvloom.kernels.paged_attention import compute_dtype


def per_row_top_k(top_k: int | torch.Tensor | None, rows: int, device) -> torch.Tensor | None:
    """top_k as an int64 tensor [rows] (None stays None); a scalar applies to every row."""
    if top_k is None:
        return None
    if isinstance(top_k, torch.Tensor):
        if top_k.shape != (rows,) or top_k.dtype.is_floating_point or top_k.dtype == torch.bool:
            raise ValueError(
                f"top_k: expected an integer tensor of shape ({rows},), "
                f"got {top_k.dtype} {tuple(top_k.shape)}"
            )
        return top_k.to(device=device, dtype=torch.int64)
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ValueError(f"top_k: expected an int, a tensor or None, got {top_k!r}")
    return torch.full((rows,), top_k, dtype=torch.int64, device=device)


def per_row_top_p(top_p: float | torch.Tensor | None, rows: int, device) -> torch.Tensor | None:
    """top_p as a float32 tensor [rows] (None stays None); a scalar must be in [0, 1]."""
    if top_p is None:
        return None
    if isinstance(top_p, torch.Tensor):
        if top_p.shape != (rows,) or not top_p.dtype.is_floating_point:
            raise ValueError(
                f"top_p: expected a float tensor of shape ({rows},), "
                f"got {top_p.dtype} {tuple(top_p.shape)}"
            )
        return top_p.to(device=device, dtype=torch.float32)
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
        raise ValueError(f"top_p: expected a float, a tensor or None, got {top_p!r}")
    if not 0.0 <= float(top_p) <= 1.0:
        raise ValueError(f"top_p: must be in [0, 1], got {top_p}")
    return torch.full((rows,), float(top_p), dtype=torch.float32, device=device)


def check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(
            f"logits: expected [rows, vocab] with vocab > 0, got {tuple(logits.shape)}"
        )
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits: expected a float dtype, got {logits.dtype}")


def sanitize_logits(logits: torch.Tensor) -> torch.Tensor:
    """Step 1 of the module docstring, in the compute dtype."""
    acc = compute_dtype(logits.dtype)
    x = logits.to(acc)
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(acc).max, neginf=float("-inf"))
    no_finite = ~(x > float("-inf")).any(dim=-1, keepdim=True)
    return torch.where(no_finite, torch.zeros_like(x), x)


def top_k_top_p_probs_ref(
    logits: torch.Tensor,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """logits: [rows, vocab] (temperature already applied); returns probabilities, same
    shape, float32 (float64 for float64 logits)."""
    check_logits(logits)
    rows, vocab = logits.shape
    ks = per_row_top_k(top_k, rows, logits.device)
    ps = per_row_top_p(top_p, rows, logits.device)
    x = sanitize_logits(logits)
    if ks is not None:
        active = (ks > 0) & (ks < vocab)
        ordered = x.sort(dim=-1, descending=True).values
        kth = ordered.gather(-1, (ks.clamp(1, vocab) - 1)[:, None])
        keep = (x >= kth) | ~active[:, None]
        x = x.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if ps is not None:
        active = ps < 1.0  # NaN compares False: no filtering
        ordered = probs.sort(dim=-1, descending=True).values
        reached = ordered.cumsum(dim=-1) >= ps.to(probs.dtype)[:, None]
        # Rounding can leave the total just under p: then every token stays.
        last = torch.full((rows,), vocab - 1, dtype=torch.int64, device=probs.device)
        first = torch.where(reached.any(dim=-1), reached.int().argmax(dim=-1), last)
        threshold = ordered.gather(-1, first[:, None])
        keep = (probs >= threshold) | ~active[:, None]
        probs = probs.masked_fill(~keep, 0.0)
        probs = torch.where(active[:, None], probs / probs.sum(dim=-1, keepdim=True), probs)
    return probs
