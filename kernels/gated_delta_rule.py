"""Gated delta rule (Gated DeltaNet, Qwen3-Next): pure-torch reference kernels.

Per value head, with a state S of shape [Dk, Dv] (key dim first, as transformers and fla), a
token (q, k, v, g, beta) does

    S <- exp(g) * S                         decay (g is a log-decay, g <= 0)
    S <- S + k (beta * (v - S^T k))^T       delta-rule write: only the part S mispredicts
    o  = S^T (scale * q)                    read with the updated state

with q, k L2-normalised first when `use_qk_l2norm` (then scaled; `scale` defaults to Dk**-0.5).
This is the math of transformers' `torch_chunk_gated_delta_rule` /
`torch_recurrent_gated_delta_rule` (Qwen3-Next torch fallback) and of fla's kernels.

Layouts are token-major and packed, as the serving engine holds them:
  q, k  [T, Hk, Dk]      v [T, Hv, Dv]      g, beta [T, Hv]      state [N, Hv, Dk, Dv]
Hv may be a multiple of Hk (grouped value heads): value head h reads key head h // (Hv // Hk),
which is transformers' `repeat_interleave` over the key heads.

Computation runs in float32, or float64 when q is float64; the output has q's dtype and a
returned state has the dtype of the state it continues.

The chunked machinery here is shared with `kda.py`: KDA is the same recurrence with a decay per
key channel (g of shape [..., Dk]); every helper below accepts either decay shape.
"""

from dataclasses import dataclass
from typing import NoReturn

import torch

from kvloom.kernels.l2norm import l2norm

# Cap on the elements of one batch of the intra-chunk pairwise tensors (bounds peak memory).
_INTRA_CHUNK_ELEMENT_BUDGET = 1 << 22


# ----------------------------------------------------------------------------- validation


def _fail(field: str, message: str) -> NoReturn:
    raise ValueError(f"{field}: {message}")


def check_shape(field: str, tensor: torch.Tensor, shape: tuple) -> None:
    """Require `tensor` to have `shape` (None entries match any size)."""
    if not isinstance(tensor, torch.Tensor):
        _fail(field, f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != len(shape) or any(
        want is not None and got != want for got, want in zip(tensor.shape, shape)
    ):
        wanted = ", ".join("*" if s is None else str(s) for s in shape)
        _fail(field, f"expected shape [{wanted}], got {list(tensor.shape)}")


def check_floating(field: str, tensor: torch.Tensor) -> None:
    if not tensor.is_floating_point():
        _fail(field, f"expected a floating-point tensor, got {tensor.dtype}")


def check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate q/k/v shapes; return (T, Hv, Dk, Dv)."""
    check_shape("q", q, (None, None, None))
    check_floating("q", q)
    check_shape("k", k, tuple(q.shape))
    check_shape("v", v, (q.shape[0], None, None))
    num_k_heads, num_v_heads = q.shape[1], v.shape[1]
    if num_k_heads == 0 or num_v_heads % num_k_heads != 0:
        _fail("v", f"value heads ({num_v_heads}) must be a multiple of key heads ({num_k_heads})")
    return q.shape[0], num_v_heads, q.shape[2], v.shape[2]


def cu_seqlens_to_list(cu_seqlens: torch.Tensor, num_tokens: int) -> list[int]:
    """Validate sequence boundaries [N+1] (0, ..., num_tokens, non-decreasing)."""
    check_shape("cu_seqlens", cu_seqlens, (None,))
    if cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
        _fail("cu_seqlens", f"expected an integer tensor, got {cu_seqlens.dtype}")
    bounds = cu_seqlens.tolist()
    if not bounds or bounds[0] != 0 or bounds[-1] != num_tokens:
        _fail("cu_seqlens", f"must start at 0 and end at the token count {num_tokens}: {bounds}")
    if any(b < a for a, b in zip(bounds, bounds[1:])):
        _fail("cu_seqlens", f"must be non-decreasing: {bounds}")
    return bounds


def check_state_indices(state_indices: torch.Tensor, num_rows: int, num_slots: int) -> None:
    """Slots of a state pool, one per row; negative marks a padding row."""
    check_shape("state_indices", state_indices, (num_rows,))
    if state_indices.is_floating_point() or state_indices.dtype == torch.bool:
        _fail("state_indices", f"expected an integer tensor, got {state_indices.dtype}")
    used = state_indices[state_indices >= 0]
    if used.numel() and int(used.max()) >= num_slots:
        _fail("state_indices", f"slot {int(used.max())} is out of range for {num_slots} slots")
    if used.unique().numel() != used.numel():
        _fail("state_indices", "two rows share one state slot")


# ----------------------------------------------------------------------------- preparation


def compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def prepare_query_key(
    q: torch.Tensor,
    k: torch.Tensor,
    num_v_heads: int,
    scale: float | None,
    use_qk_l2norm: bool,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast, L2-normalise (optional), scale q, and expand key heads to the value heads."""
    q, k = q.to(dtype), k.to(dtype)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    group = num_v_heads // q.shape[-2]
    if group > 1:
        q = q.repeat_interleave(group, dim=-2)
        k = k.repeat_interleave(group, dim=-2)
    return q, k


def select_initial_state(
    initial_state: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    field: str = "initial_state",
) -> torch.Tensor:
    """Per-sequence starting state: the given one where has_initial_state, else zeros.

    torch.where, not a multiply by 0: a slot without a valid state may hold NaN (sanitizer),
    and NaN * 0 is NaN. `field` names the state argument in errors.
    """
    zeros = torch.zeros(shape, dtype=dtype, device=device)
    if initial_state is None:
        if has_initial_state is not None:
            _fail("has_initial_state", f"given without {field}")
        return zeros
    check_shape(field, initial_state, shape)
    check_floating(field, initial_state)
    if has_initial_state is None:
        _fail("has_initial_state", f"required when {field} is given")
    check_shape("has_initial_state", has_initial_state, (shape[0],))
    if has_initial_state.dtype != torch.bool:
        _fail("has_initial_state", f"expected a bool tensor, got {has_initial_state.dtype}")
    keep = has_initial_state.to(device).view(-1, *([1] * (len(shape) - 1)))
    return torch.where(keep, initial_state.to(dtype), zeros)


# ----------------------------------------------------------------------------- chunk layout


@dataclass(frozen=True)
class ChunkLayout:
    """Each sequence cut into chunks that start at its own first token.

    Chunks are numbered sequence by sequence; slot c of chunk m holds packed token
    `token_index[m, c]`, or the pad index `num_tokens` past the sequence's end (a pad slot
    reads zeros: k = v = beta = g = 0, which leaves the state unchanged).
    """

    width: int
    token_index: torch.Tensor  # [M, width] int64
    valid: torch.Tensor  # [M, width] bool
    first_chunk: torch.Tensor  # [N] int64, index of each sequence's first chunk
    num_chunks: torch.Tensor  # [N] int64


def make_chunk_layout(bounds: list[int], chunk_size: int, device: torch.device) -> ChunkLayout:
    if not isinstance(chunk_size, int) or chunk_size < 1:
        _fail("chunk_size", f"expected a positive int, got {chunk_size!r}")
    lens = [b - a for a, b in zip(bounds, bounds[1:])]
    # Chunks narrower than chunk_size when every sequence is short: same result, less padding.
    width = max(1, min(chunk_size, max(lens, default=1)))
    counts = [-(-n // width) for n in lens]
    starts, owners = [], []
    for seq, (begin, count) in enumerate(zip(bounds, counts)):
        starts += [begin + i * width for i in range(count)]
        owners += [seq] * count
    ends = torch.tensor([bounds[s + 1] for s in owners], dtype=torch.int64).view(-1, 1)
    tokens = torch.tensor(starts, dtype=torch.int64).view(-1, 1) + torch.arange(width)
    valid = tokens < ends
    num_chunks = torch.tensor(counts, dtype=torch.int64)
    return ChunkLayout(
        width=width,
        token_index=torch.where(valid, tokens, bounds[-1]).to(device),
        valid=valid.to(device),
        first_chunk=(torch.cumsum(num_chunks, 0) - num_chunks).to(device),
        num_chunks=num_chunks.to(device),
    )


def gather_chunks(x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """[T, H, ...] tokens -> [M, H, width, ...] chunks, zeros in pad slots."""
    padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return padded[layout.token_index].transpose(1, 2)


# ----------------------------------------------------------------------------- chunked form


@dataclass
class _ChunkTerms:
    """Per-chunk quantities of the chunked delta rule (see `_intra_chunk_terms`)."""

    q_decayed: torch.Tensor  # [m, H, C, Dk]
    k_to_end: torch.Tensor  # [m, H, C, Dk]
    attn: torch.Tensor  # [m, H, C, C]
    u: torch.Tensor  # [m, H, C, Dv]
    w: torch.Tensor  # [m, H, C, Dk]
    end_decay: torch.Tensor  # [m, H, Dk or 1, 1]


def _intra_chunk_terms(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> _ChunkTerms:
    """Everything about a chunk that does not depend on the state entering it.

    With G_t the cumulative log-decay from the chunk start and S0 the entering state, the
    writes d_t = beta_t (v_t - S_{t-1}'^T k_t) of the chunk solve the unit lower-triangular
    system (I + A) d = beta v - (beta k * exp(G)) S0, A[t, s] = beta_t k_t^T diag(e^(G_t-G_s)) k_s
    for s < t; so d = u - w S0 with u, w below. Then
      o_t   = (q_t * e^G_t)^T S0 + sum_{s<=t} q_t^T diag(e^(G_t-G_s)) k_s d_s
      S_end = e^G_end * S0 + sum_s (k_s * e^(G_end-G_s)) d_s^T.
    g is [m, H, C] (one decay per head) or [m, H, C, Dk] (one per key channel).
    """
    dtype, width = q.dtype, q.shape[2]
    per_channel = g.dim() == 4
    # Cumulative decays in float64: pairwise differences of long sums keep their precision.
    cum = g.to(torch.float64).cumsum(dim=2)
    cum_col = cum if per_channel else cum.unsqueeze(-1)  # broadcasts against [.., C, Dk]
    cum_end = cum_col[:, :, -1:]
    causal = torch.ones(width, width, dtype=torch.bool, device=q.device).tril()
    k_beta = k * beta.unsqueeze(-1)
    if per_channel:
        gap = cum.unsqueeze(3) - cum.unsqueeze(2)  # [m, H, t, s, Dk]: G_t - G_s
        pair_decay = gap.masked_fill(~causal.unsqueeze(-1), float("-inf")).exp().to(dtype)
        kk = torch.einsum("mhtsd,mhsd->mhts", pair_decay * k_beta.unsqueeze(3), k)
        attn = torch.einsum("mhtsd,mhsd->mhts", pair_decay * q.unsqueeze(3), k)
    else:
        gap = cum.unsqueeze(3) - cum.unsqueeze(2)  # [m, H, t, s]
        pair_decay = gap.masked_fill(~causal, float("-inf")).exp().to(dtype)
        kk = (k_beta @ k.transpose(-1, -2)) * pair_decay
        attn = (q @ k.transpose(-1, -2)) * pair_decay
    system = kk.tril(-1) + torch.eye(width, dtype=dtype, device=q.device)
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * cum_col.exp().to(dtype)], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    return _ChunkTerms(
        q_decayed=q * cum_col.exp().to(dtype),
        k_to_end=k * (cum_end - cum_col).exp().to(dtype),
        attn=attn,
        u=u,
        w=w,
        end_decay=cum_end.exp().to(dtype).transpose(-1, -2),
    )


def _all_chunk_terms(q, k, v, g, beta) -> _ChunkTerms:
    """`_intra_chunk_terms` over all chunks, in batches that bound the pairwise tensors."""
    num_chunks, heads, width = q.shape[:3]
    per_chunk = heads * width * width * (g.shape[-1] if g.dim() == 4 else 1)
    step = max(1, _INTRA_CHUNK_ELEMENT_BUDGET // per_chunk)
    parts = [
        _intra_chunk_terms(*(x[i : i + step] for x in (q, k, v, g, beta)))
        for i in range(0, max(num_chunks, 1), step)  # one empty batch when there are no chunks
    ]
    if len(parts) == 1:
        return parts[0]
    fields = _ChunkTerms.__dataclass_fields__
    return _ChunkTerms(**{name: torch.cat([getattr(p, name) for p in parts]) for name in fields})


def delta_rule_chunked_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    bounds: list[int],
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared chunked core. q, k, v, g, beta are prepared (compute dtype, heads expanded,
    q scaled); g is [T, H] or [T, H, Dk]; `state` [N, H, Dk, Dv] is the starting state and is
    overwritten with the final one. Returns (out [T, H, Dv], state)."""
    layout = make_chunk_layout(bounds, chunk_size, q.device)
    terms = _all_chunk_terms(*(gather_chunks(x, layout) for x in (q, k, v, g, beta)))
    chunk_out = terms.u.new_empty(terms.u.shape)
    # Sequential scan: step j advances every sequence that has a j-th chunk.
    max_chunks = int(layout.num_chunks.max()) if layout.num_chunks.numel() else 0
    for j in range(max_chunks):
        seqs = torch.nonzero(layout.num_chunks > j).flatten()
        ids = layout.first_chunk[seqs] + j
        entering = state[seqs]
        writes = terms.u[ids] - terms.w[ids] @ entering
        chunk_out[ids] = terms.q_decayed[ids] @ entering + terms.attn[ids] @ writes
        state[seqs] = (
            entering * terms.end_decay[ids] + terms.k_to_end[ids].transpose(-1, -2) @ writes
        )
    out = v.new_zeros(v.shape)
    out[layout.token_index[layout.valid]] = chunk_out.transpose(1, 2)[layout.valid]
    return out, state


def delta_rule_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """Shared one-token step. q, k, v, g, beta prepared as for the chunked core, leading dim N
    (one row per sequence); rows with state_indices < 0 are padding. Updates `state_pool`
    in place at the used slots and returns out [N, H, Dv] (zeros on padding rows)."""
    rows = torch.nonzero(state_indices >= 0).flatten()
    slots = state_indices[rows].to(torch.int64).to(state_pool.device)
    state = state_pool[slots].to(q.dtype)
    decay = g[rows].exp()
    state = state * (decay.unsqueeze(-1) if g.dim() == 3 else decay[..., None, None])
    k_r = k[rows]
    predicted = torch.einsum("nhk,nhkv->nhv", k_r, state)
    writes = beta[rows].unsqueeze(-1) * (v[rows] - predicted)
    state = state + k_r.unsqueeze(-1) * writes.unsqueeze(-2)
    out = v.new_zeros(v.shape)
    out[rows] = torch.einsum("nhk,nhkv->nhv", q[rows], state)
    state_pool[slots] = state.to(state_pool.dtype)
    return out


# ----------------------------------------------------------------------------- public API


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over N packed sequences (prefill, or prefill chunks that resume).

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g (log-decay, <= 0) and beta [T, Hv]; cu_seqlens [N+1].
    initial_state [N, Hv, Dk, Dv] holds each sequence's state, gathered by the caller; it is
    read only where has_initial_state [N] (bool) is True, and elsewhere the sequence starts
    from zeros (the slot may hold garbage). initial_state=None means all start from zeros.
    Returns (out [T, Hv, Dv] in q's dtype, final_state [N, Hv, Dk, Dv]).
    """
    num_tokens, num_v_heads, _, _ = check_heads(q, k, v)
    check_shape("g", g, (num_tokens, num_v_heads))
    check_shape("beta", beta, (num_tokens, num_v_heads))
    return run_chunked(
        q,
        k,
        v,
        g,
        beta,
        cu_seqlens,
        initial_state,
        has_initial_state,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        chunk_size=chunk_size,
    )


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> torch.Tensor:
    """One decode step for each of N sequences, each continuing its own state.

    q, k [N, Hk, Dk]; v [N, Hv, Dv]; g, beta [N, Hv]; `state` is the whole pool
    [num_slots, Hv, Dk, Dv], updated in place at rows state_indices [N]. A row whose index is
    negative is padding: its slot is not touched and its output is zeros.
    Returns out [N, Hv, Dv] in q's dtype.
    """
    num_rows, num_v_heads, _, _ = check_heads(q, k, v)
    check_shape("g", g, (num_rows, num_v_heads))
    check_shape("beta", beta, (num_rows, num_v_heads))
    return run_decode_step(
        q, k, v, g, beta, state, state_indices, scale=scale, use_qk_l2norm=use_qk_l2norm
    )


def run_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    *,
    scale: float | None,
    use_qk_l2norm: bool,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validation and preparation common to GDN and KDA, then the shared chunked core.
    q/k/v/g/beta shapes must already be checked."""
    num_tokens, num_v_heads, head_k, head_v = q.shape[0], v.shape[1], q.shape[2], v.shape[2]
    bounds = cu_seqlens_to_list(cu_seqlens, num_tokens)
    out_dtype, dtype = q.dtype, compute_dtype(q)
    shape = (len(bounds) - 1, num_v_heads, head_k, head_v)
    state = select_initial_state(initial_state, has_initial_state, shape, dtype, q.device)
    q, k = prepare_query_key(q, k, num_v_heads, scale, use_qk_l2norm, dtype)
    out, state = delta_rule_chunked_varlen(
        q, k, v.to(dtype), g.to(dtype), beta.to(dtype), bounds, state, chunk_size
    )
    final_dtype = dtype if initial_state is None else initial_state.dtype
    return out.to(out_dtype), state.to(final_dtype)


def run_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    scale: float | None,
    use_qk_l2norm: bool,
) -> torch.Tensor:
    """Validation and preparation common to GDN and KDA, then the shared one-token step.
    q/k/v/g/beta shapes must already be checked."""
    num_rows, num_v_heads, head_k, head_v = q.shape[0], v.shape[1], q.shape[2], v.shape[2]
    check_shape("state", state, (None, num_v_heads, head_k, head_v))
    check_floating("state", state)
    check_state_indices(state_indices, num_rows, state.shape[0])
    out_dtype, dtype = q.dtype, compute_dtype(q)
    q, k = prepare_query_key(q, k, num_v_heads, scale, use_qk_l2norm, dtype)
    out = delta_rule_decode_step(
        q, k, v.to(dtype), g.to(dtype), beta.to(dtype), state, state_indices
    )
    return out.to(out_dtype)
