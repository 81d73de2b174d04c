"""The batch-invariant split-KV decode (`paged_attention_decode_split_triton`): fixed-size
key splits, each a float32 partial, merged per row in split order.

Checked here: the torch reference at edge lengths (1 key, exactly one split, one key past
it, several splits and pages, sliding windows, DCP shards, half and FP8 caches, padding
rows as CUDA graphs lay them out, rows without keys), and that a row's bits depend on its
own keys only: not on the other rows, their order, the batch size, the grid, the host
bound on lengths, the block table's width or the partial buffers' size. The log-sum-exp
merge itself: parts without keys leave the bits unchanged.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set by the
conftests) at tiny shapes, with small splits (32 or 64 keys, a multiple of the decode
plan's key tile) so short rows cross several; with CUDA the same tests run compiled, and
the `gpu`-marked ones add Qwen3-8B's attention shape in bfloat16 at contexts up to 8192,
the production split size and a CUDA-graph capture.

Caches are poisoned as the sanitizer does (unused pages, slots past a row's keys and pages
wholly before its window hold NaN); outputs and partial buffers start as NaN, so reading
a key or a partial that must not be read, or leaving an element unwritten, fails.
"""

from __future__ import annotations

import math
import os
import types
import zlib

import pytest
import torch

from kvloom.kernels.kv_cache_write import FP8_DTYPE, quantize_kv
from kvloom.kernels.merge_attention_states_triton import merge_attention_states_triton
from kvloom.kernels.paged_attention import paged_attention_ref
from kvloom.kernels.paged_attention_triton import (
    DECODE_KEYS_PER_SPLIT,
    DECODE_SPLIT_PLAN,
    _plans,
    decode_split_plan,
    decode_split_slots,
    paged_attention_decode_split_triton,
    paged_attention_triton,
)
from tests.kernel_env import CUDA, DEVICE, gpu, needs_cuda

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(
    not CUDA and not INTERPRETED,
    reason="triton was imported for the compiler first and there is no GPU",
)

ATTN_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}
LSE_TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (1e-4, 1e-5), torch.bfloat16: (1e-4, 1e-5)}
# Split sizes for the tiny shapes: one or two key tiles of the decode plan (32 keys under
# a float32 q, 64 under a half one), so short rows cross several splits.
SMALL_KEYS = {torch.float32: 32, torch.float16: 64, torch.bfloat16: 64}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def check_close(name, actual, expected, atol, rtol):
    """assert_close plus the error it saw; infinities (rows without keys) must match."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert not torch.isnan(a).any(), f"{name}: NaN in the kernel's output"
    diff = (a - e)[torch.isfinite(e)]
    print(f"ERRNORM {name}: max_abs={diff.abs().max().item() if diff.numel() else 0.0:.3e}")
    torch.testing.assert_close(a, e, atol=atol, rtol=rtol, equal_nan=False)


class Rows:
    """Decode rows with fixed data: row i has `contexts[i]` keys and values and one query,
    drawn from a generator seeded by (seed, i), so a row is the same in every batch."""

    def __init__(self, contexts, *, num_kv_heads=2, group=2, head_dim=16, seed=0):
        self.contexts = list(contexts)
        self.q, self.kv = [], []
        for i, ctx in enumerate(self.contexts):
            g = gen(1000 * seed + i)
            self.q.append(torch.randn(1, num_kv_heads * group, head_dim, generator=g))
            self.kv.append(torch.randn(2, ctx, num_kv_heads, head_dim, generator=g))
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim

    def case(self, order, *, page=8, window=None, pad_rows=0, extra_pages=0, **layout):
        """Kernel arguments for rows `order` (indices, repeats allowed) in that order, then
        `pad_rows` padding rows as a CUDA graph lays them out (zero-length, seq_len 0,
        their tokens past query_start_loc[-1]). Pages are shuffled; table entries a row
        does not need, pages wholly before its window and slots past its keys are NaN.
        `extra_pages` widens the block table (more split slots). layout: q_dtype,
        cache_dtype (k_scale / v_scale for FP8), kv_stride / kv_offset (a DCP rank's
        share: local index i holds position kv_offset + i * kv_stride)."""
        stride, offset = layout.get("kv_stride", 1), layout.get("kv_offset", 0)
        q_dtype = layout.get("q_dtype", torch.float32)
        cache_dtype = layout.get("cache_dtype", q_dtype)
        k_scale, v_scale = layout.get("k_scale", 1.0), layout.get("v_scale", 1.0)
        shares = [self.kv[i][:, offset::stride] for i in order]
        need = [max(1, math.ceil(s.shape[1] / page)) for s in shares]
        num_pages = sum(need) + 1
        cache = torch.full((2, num_pages, page, self.num_kv_heads, self.head_dim), float("nan"))
        poison = num_pages - 1
        shuffled = torch.randperm(num_pages - 1, generator=gen(len(order) + 7 * page)).tolist()
        width = max(need) + 1 + extra_pages
        tables = torch.full((len(order) + pad_rows, width), poison, dtype=torch.int32)
        for r, (i, share) in enumerate(zip(order, shares, strict=True)):
            ctx = self.contexts[i]
            first = 0 if window is None else max(0, ctx - window)
            first_local = max(0, -(-(first - offset) // stride))
            for b in range(math.ceil(share.shape[1] / page)):
                pid = shuffled.pop()
                chunk = share[:, b * page : (b + 1) * page]
                cache[:, pid, : chunk.shape[1]] = chunk
                if (b + 1) * page > first_local:  # else freed by the window: poisoned
                    tables[r, b] = pid
        keys = quantize_kv(cache[0], cache_dtype, k_scale)  # a plain cast unless FP8
        values = quantize_kv(cache[1], cache_dtype, v_scale)
        n = len(order)
        q = torch.cat([self.q[i] for i in order] + [torch.randn(pad_rows, *self.q[0].shape[1:])])
        qsl = list(range(n + 1)) + [n] * pad_rows
        lens = [self.contexts[i] for i in order] + [0] * pad_rows
        case = dict(
            q=q.to(dtype=q_dtype, device=DEVICE),
            kv_cache=torch.stack([keys, values]).to(DEVICE),
            block_tables=tables.to(DEVICE),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
            scale=self.head_dim**-0.5,
            sliding_window=window,
            kv_stride=stride,
            kv_offset=offset,
        )
        if cache_dtype == FP8_DTYPE:
            case.update(k_scale=k_scale, v_scale=v_scale)
        return case


def run_split(case, keys, *, scratch_rows=None, scratch_slots=None, **kwargs):
    """The split decode into NaN-filled outputs and NaN-filled partial buffers (at least
    `scratch_rows` rows and `scratch_slots` slots), so an unwritten output element or a
    read of an unwritten partial shows up as NaN."""
    q = case["q"]
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)
    slots = decode_split_slots(case["block_tables"], case["kv_cache"], keys)
    rows = max(scratch_rows or 0, q.shape[0])
    shape = (max(scratch_slots or 0, slots), rows, q.shape[1])
    parts = torch.full((*shape, q.shape[2]), float("nan"), device=q.device)
    part_lses = torch.full(shape, float("nan"), device=q.device)
    got = paged_attention_decode_split_triton(
        **case,
        keys_per_split=keys,
        out=out,
        lse=lse,
        parts=parts,
        part_lses=part_lses,
        **kwargs,
    )
    assert got[0] is out and got[1] is lse
    return out, lse


def check_reference(name, case, keys, **kwargs):
    out, lse = run_split(case, keys, **kwargs)
    ref_out, ref_lse = paged_attention_ref(**case)
    dtype = case["q"].dtype
    check_close(f"{name} out", out, ref_out, *ATTN_TOL[dtype])
    check_close(f"{name} lse", lse, ref_lse, *LSE_TOL[dtype])
    return out, lse


def zlib_seed(name: str) -> int:
    return zlib.crc32(name.encode()) % 1000


def edge_contexts(keys: int) -> list[int]:
    """1 key, one page, one split exactly, one key past it, several splits."""
    return [1, 8, keys - 1, keys, keys + 1, 2 * keys, 3 * keys + 5]


# ------------------------------------------------------------------------------ CPU tests


@pytest.mark.parametrize("window", [None, 1, 5, 40])
@pytest.mark.parametrize("group", [1, 4])
def test_matches_reference_at_edge_lengths(group, window):
    """Float32 at the edge lengths, with and without a window (1: a query sees only
    itself; 40: it reaches back past a split boundary, so leading splits are skipped),
    and two padding rows after the real ones, as a CUDA graph pads."""
    keys = SMALL_KEYS[torch.float32]
    rows = Rows(edge_contexts(keys), group=group, seed=group)
    case = rows.case(range(len(rows.contexts)), window=window, pad_rows=2)
    out, lse = check_reference(f"split g{group} w{window}", case, keys, grid_splits=2)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))  # padding tokens
    assert torch.isneginf(lse[-2:]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 70])
def test_half_precision(dtype, window):
    keys = SMALL_KEYS[dtype]
    rows = Rows(edge_contexts(keys), seed=3)
    case = rows.case(range(len(rows.contexts)), window=window, q_dtype=dtype)
    check_reference(f"split {dtype} w{window}", case, keys)
    # Beside the one-pass kernel, which sums the same keys in other groups.
    out, _ = run_split(case, keys)
    one_pass, _ = paged_attention_triton(**case, max_query_len=1)
    check_close(f"split {dtype} w{window} vs one pass", out, one_pass, *ATTN_TOL[dtype])


def test_the_split_plan_takes_128_key_tiles_where_a_split_holds_them():
    """DECODE_SPLIT_PLAN replaces the half-precision short plan's 64-key tile when a
    split is whole 128-key tiles; float32 (32-key tile), MLA's 16 and 64-key splits keep
    the short plan."""
    half, _ = _plans(4, 128, torch.bfloat16)
    assert decode_split_plan(half, 256) == {**half, **DECODE_SPLIT_PLAN}
    assert decode_split_plan(half, 256)["TILE"] == 128
    assert decode_split_plan(half, 64) == half
    assert decode_split_plan(half, 192) == half  # not whole 128-key tiles
    wide, _ = _plans(4, 128, torch.float32)
    assert decode_split_plan(wide, 256) == wide
    mla, _ = _plans(16, 576, torch.bfloat16)
    assert decode_split_plan(mla, 256) == mla


def test_half_precision_with_the_128_key_split_tile():
    """The production split size's plan (128-key tiles) against the reference, the one-
    pass kernel and a split count that makes the grid loop over splits."""
    keys = 128
    rows = Rows([1, 100, keys, keys + 1, 3 * keys + 5], seed=5)
    case = rows.case(range(5), q_dtype=torch.bfloat16, pad_rows=1)
    out, _ = check_reference("split bf16 k128", case, keys, grid_splits=2)
    one_pass, _ = paged_attention_triton(**case, max_query_len=1)
    check_close("split bf16 k128 vs one pass", out, one_pass, *ATTN_TOL[torch.bfloat16])
    again, _ = run_split(case, keys, grid_splits=1)
    assert torch.equal(out, again)  # the grid never changes a split's sums


@pytest.mark.parametrize(("dcp", "window"), [(2, None), (4, None), (2, 9), (4, 50)])
def test_dcp_shards(dcp, window):
    """Every rank of a DCP group: splits of local indices (a shard holds about ctx / dcp
    keys), the window masked on global positions. A rank without any key of a row (one
    key, rank > 0) gives it output 0 and lse -inf."""
    keys = SMALL_KEYS[torch.float32]
    rows = Rows([1, 3, 2 * keys + 1, 4 * keys + 3, 9 * keys], seed=dcp)
    for rank in range(dcp):
        case = rows.case(range(5), window=window, kv_stride=dcp, kv_offset=rank, pad_rows=1)
        out, lse = check_reference(f"dcp{dcp} rank {rank} w{window}", case, keys)
        if rank > 0:
            assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()


def test_dcp_float32_partials_over_a_half_cache():
    """The DCP layer's float32 q over its bfloat16 cache (widened exactly)."""
    keys = SMALL_KEYS[torch.float32]
    rows = Rows([5, 2 * keys + 3, 3 * keys], seed=11)
    layout = dict(q_dtype=torch.float32, cache_dtype=torch.bfloat16, kv_stride=2, kv_offset=1)
    check_reference("dcp float32 q over bf16", rows.case(range(3), **layout), keys)


def test_fp8_cache():
    keys = SMALL_KEYS[torch.bfloat16]
    rows = Rows(edge_contexts(keys), seed=12)
    layout = dict(q_dtype=torch.bfloat16, cache_dtype=FP8_DTYPE, k_scale=0.03, v_scale=0.02)
    check_reference("split fp8", rows.case(range(len(rows.contexts)), **layout), keys)


def test_row_bits_do_not_depend_on_batch_grid_or_bounds():
    """One row's output and lse, bitwise: alone, among rows of other lengths in either
    order, in a batch of 13, with a wider block table (more split slots), larger NaN
    scratch buffers, any grid (1 program per row and head looping over every split, up
    to one program per split) and any host bound on the lengths."""
    keys = SMALL_KEYS[torch.float32]
    contexts = [3 * keys + 5, 1, keys, 5 * keys + 2, keys + 1, 17, 2 * keys]
    rows = Rows(contexts, seed=21)
    n = len(contexts)
    batch = run_split(rows.case(range(n)), keys)
    variants = {
        "reversed": (list(reversed(range(n))), {}, {}),
        "13 rows, padded": ([*range(n), *range(n - 1)], dict(pad_rows=3), {}),
        "wide table, big scratch": (
            list(range(n)),
            dict(extra_pages=30),
            dict(scratch_rows=40, scratch_slots=50),
        ),
        "grid 1": (list(range(n)), {}, dict(grid_splits=1)),
        "grid 3": (list(range(n)), {}, dict(grid_splits=3)),
        "grid 64": (list(range(n)), {}, dict(grid_splits=64)),
        "bound 1": (list(range(n)), {}, dict(max_seq_len=1)),
        "bound 10**6": (list(range(n)), {}, dict(max_seq_len=10**6)),
    }
    for name, (order, layout, kwargs) in variants.items():
        out, lse = run_split(rows.case(order, **layout), keys, **kwargs)
        for pos, i in enumerate(order):
            assert torch.equal(out[pos], batch[0][i]), f"{name}: row {i} output differs"
            assert torch.equal(lse[pos], batch[1][i]), f"{name}: row {i} lse differs"
    for i in range(n):
        out, lse = run_split(rows.case([i]), keys)
        assert torch.equal(out[0], batch[0][i]) and torch.equal(lse[0], batch[1][i]), i


@pytest.mark.parametrize("window", [None, 45])
def test_windowed_and_sharded_rows_are_batch_invariant(window):
    """The same with a window and on a DCP shard (rank 1 of 2)."""
    keys = SMALL_KEYS[torch.float32]
    contexts = [4 * keys + 1, 6, 2 * keys + 7]
    rows = Rows(contexts, seed=31)
    layout = dict(window=window, kv_stride=2, kv_offset=1)
    batch = run_split(rows.case(range(3), **layout), keys)
    for i in range(3):
        out, lse = run_split(rows.case([i], **layout), keys, grid_splits=1)
        assert torch.equal(out[0], batch[0][i]) and torch.equal(lse[0], batch[1][i]), i


def test_rows_without_keys():
    """A one-token row with no context cannot occur in a decode, but gets output 0 and
    lse -inf (never NaN from (-inf) - (-inf)); its neighbours are unaffected."""
    keys = SMALL_KEYS[torch.float32]
    rows = Rows([0, keys + 3, 0], seed=41)
    out, lse = check_reference("no keys", rows.case(range(3)), keys)
    for i in (0, 2):
        assert torch.equal(out[i], torch.zeros_like(out[i])) and torch.isneginf(lse[i]).all()
    alone, alone_lse = run_split(rows.case([1]), keys)
    assert torch.equal(alone[0], out[1]) and torch.equal(alone_lse[0], lse[1])


def test_merge_ignores_parts_without_keys():
    """The log-sum-exp merge (shared by the split decode): interleaving parts with lse =
    -inf and NaN outputs changes no bit; only such parts give output 0, lse -inf."""
    g = gen(51)
    parts = torch.randn(5, 3, 4, 16, generator=g).to(DEVICE)
    lses = (torch.randn(5, 3, 4, generator=g) * 3).to(DEVICE)
    want, want_lse = merge_attention_states_triton(parts, lses)
    empty = torch.full((1, 3, 4, 16), float("nan"), device=DEVICE)
    empty_lse = torch.full((1, 3, 4), float("-inf"), device=DEVICE)
    mixed = torch.cat([empty, parts[:2], empty, empty, parts[2:], empty])
    mixed_lse = torch.cat([empty_lse, lses[:2], empty_lse, empty_lse, lses[2:], empty_lse])
    got, got_lse = merge_attention_states_triton(mixed, mixed_lse)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    none, none_lse = merge_attention_states_triton(empty.expand(3, -1, -1, -1), empty_lse[[0] * 3])
    assert torch.equal(none, torch.zeros_like(none)) and torch.isneginf(none_lse).all()


def run_merged(case, keys, **kwargs):
    """The split decode merging in its attention launch (`split_merge`), into NaN-filled
    outputs and NaN-filled partials, with a counter buffer it must leave zero."""
    q = case["q"]
    counters = torch.zeros(q.shape[0] + 2, case["kv_cache"].shape[3], dtype=torch.int32)
    counters = counters.to(q.device)
    out, lse = run_split(case, keys, merge_in_launch=True, counters=counters, **kwargs)
    assert not counters.any(), "the merge left a split counter set"
    return out, lse


MERGE_CASES = {
    "float32, edge lengths, 2 padding rows": (torch.float32, None, dict(pad_rows=2), {}),
    # more padding tokens than a short row has: the pseudo-row is still this launch's
    "float32, 20 padding rows": (torch.float32, None, dict(pad_rows=20), {}),
    "float32 window 40, grid 1": (torch.float32, 40, {}, dict(grid_splits=1)),
    "float32 window 5, grid 3": (torch.float32, 5, {}, dict(grid_splits=3)),
    "float32, grid 64": (torch.float32, None, {}, dict(grid_splits=64)),
    "bfloat16, 3 padding rows": (torch.bfloat16, None, dict(pad_rows=3), {}),
    "float16 window 70, grid 2": (torch.float16, 70, {}, dict(grid_splits=2)),
    "dcp rank 1 of 2": (torch.float32, None, dict(kv_stride=2, kv_offset=1), {}),
    "fp8 cache": (
        torch.bfloat16,
        None,
        dict(cache_dtype=FP8_DTYPE, k_scale=0.03, v_scale=0.02),
        {},
    ),
}


@pytest.mark.parametrize("name", sorted(MERGE_CASES))
def test_merging_in_the_attention_launch_gives_the_merge_launchs_bits(name):
    """`split_merge`: a row of one split stored as its result, a row of several merged by
    the program that stores its last partial, padding and keyless rows 0 / -inf: the
    output and lse of the two launches, bit for bit, at every grid, window, DCP shard and
    cache dtype here; the counters are zero afterwards; a second call (a graph replay's
    reuse of the counters) gives the same bits."""
    dtype, window, layout, kwargs = MERGE_CASES[name]
    keys = SMALL_KEYS[dtype]
    rows = Rows([0, *edge_contexts(keys)], seed=zlib_seed(name))
    case = rows.case(range(len(rows.contexts)), window=window, q_dtype=dtype, **layout)
    want = run_split(case, keys, merge_in_launch=False, **kwargs)
    got = run_merged(case, keys, **kwargs)
    assert torch.equal(got[0], want[0]), f"{name}: output"
    assert torch.equal(got[1], want[1]), f"{name}: lse"
    again = run_merged(case, keys, **kwargs)
    assert torch.equal(again[0], want[0]) and torch.equal(again[1], want[1])


def test_split_merge_is_opt_in_and_never_interpreted(monkeypatch):
    from kvloom.kernels.paged_attention_triton import uses_split_merge

    cuda = types.SimpleNamespace(is_cuda=True)
    monkeypatch.delenv("KVLOOM_FUSED", raising=False)
    monkeypatch.delenv("KVLOOM_UNFUSED", raising=False)
    assert not uses_split_merge(cuda)
    monkeypatch.setenv("KVLOOM_FUSED", "split_merge")
    assert uses_split_merge(cuda)
    assert not uses_split_merge(torch.ones(1))  # the CPU: never
    monkeypatch.setenv("KVLOOM_UNFUSED", "split_merge")
    assert not uses_split_merge(cuda)


def test_rejects_bad_counters():
    keys = SMALL_KEYS[torch.float32]
    case = Rows([5, 40], seed=62).case([0, 1])
    for bad in (
        torch.zeros(2, case["kv_cache"].shape[3]),  # float32
        torch.zeros(1, case["kv_cache"].shape[3], dtype=torch.int32),  # fewer rows than T
        torch.zeros(2, case["kv_cache"].shape[3] + 1, dtype=torch.int32),
    ):
        with pytest.raises(ValueError, match="counters"):
            paged_attention_decode_split_triton(
                **case, keys_per_split=keys, merge_in_launch=True, counters=bad.to(DEVICE)
            )


def test_rejects_bad_arguments():
    keys = SMALL_KEYS[torch.float32]
    case = Rows([5, 40], seed=61).case([0, 1])
    run = paged_attention_decode_split_triton
    with pytest.raises(ValueError, match="one query token per row"):
        run(
            **dict(case, seq_lens=case["seq_lens"][:1], query_start_loc=case["query_start_loc"][:2])
        )
    with pytest.raises(ValueError, match="multiple of the key tile"):
        run(**case, keys_per_split=keys + 16)
    with pytest.raises(ValueError, match="keys_per_split"):
        run(**case, keys_per_split=0)
    with pytest.raises(ValueError, match="grid_splits"):
        run(**case, keys_per_split=keys, grid_splits=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        run(**case, keys_per_split=keys, max_seq_len=0)
    slots = decode_split_slots(case["block_tables"], case["kv_cache"], keys)
    small = torch.empty(slots - 1, 2, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="parts"):
        run(**case, keys_per_split=keys, parts=small, part_lses=torch.empty(slots - 1, 2, 4))
    with pytest.raises(ValueError, match="give both"):
        run(**case, keys_per_split=keys, parts=torch.empty(slots, 2, 4, 16, device=DEVICE))


def test_default_split_size_is_a_multiple_of_every_decode_tile():
    assert DECODE_KEYS_PER_SPLIT % 64 == 0  # the 64-, 32- and 16-key tiles of _plans


# ------------------------------------------------------------------------------ GPU tests

REAL = dict(num_kv_heads=8, group=4, head_dim=128)  # Qwen3-8B: 32 query heads, 8 KV heads


@gpu
@needs_cuda
@pytest.mark.parametrize("window", [None, 1000])
def test_gpu_real_shapes_match_reference_and_are_batch_invariant(window):
    """Qwen3-8B's attention shape in bfloat16, contexts 1 to 8192, the production split
    size, pages of 16: against the reference; each row bitwise the same alone (grid sized
    for one row), in the batch (grid for 12 rows), under a graph's bound (40960) and
    beside 52 more rows."""
    contexts = [1, 17, 255, 256, 257, 640, 1000, 2048, 4095, 4096, 5000, 8192]
    rows = Rows(contexts, seed=71, **REAL)
    n, keys = len(contexts), DECODE_KEYS_PER_SPLIT
    layout = dict(page=16, window=window, q_dtype=torch.bfloat16)
    case = rows.case(range(n), **layout)
    batch = check_reference(f"gpu split w{window}", case, keys)
    one_pass, _ = paged_attention_triton(**case, max_query_len=1)
    check_close(f"gpu split w{window} vs one pass", batch[0], one_pass, *ATTN_TOL[torch.bfloat16])
    big = rows.case([*range(n)] + [i % n for i in range(52)], **layout)
    for name, (c, kwargs) in {
        "bound 40960": (case, dict(max_seq_len=40960)),
        "64 rows": (big, {}),
    }.items():
        out, lse = run_split(c, keys, **kwargs)
        assert torch.equal(out[:n], batch[0]) and torch.equal(lse[:n], batch[1]), name
    for i in range(n):
        out, lse = run_split(rows.case([i], **layout), keys)
        assert torch.equal(out[0], batch[0][i]) and torch.equal(lse[0], batch[1][i]), i


@gpu
@needs_cuda
def test_gpu_split_decode_in_a_cuda_graph():
    """Captured once over static buffers (the scratch never reallocated), replayed with
    other lengths and a padding row: bitwise the eager call's answer."""
    keys = DECODE_KEYS_PER_SPLIT
    rows = Rows([3000, 700, 1, 4096], seed=81, **REAL)
    layout = dict(page=16, q_dtype=torch.bfloat16, extra_pages=300)
    static = rows.case([0, 1, 2, 3], **layout)
    out = torch.empty_like(static["q"])
    lse = torch.empty(static["q"].shape[:2], device=DEVICE)
    slots = decode_split_slots(static["block_tables"], static["kv_cache"], keys)
    parts = torch.empty(slots, 4, 32, 128, device=DEVICE)
    part_lses = torch.empty(slots, 4, 32, device=DEVICE)

    def launch():
        paged_attention_decode_split_triton(
            **static, max_seq_len=8192, parts=parts, part_lses=part_lses, out=out, lse=lse
        )

    launch()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    # Other rows in the same buffers: rows 3, 1, 0 and a padding row.
    step = rows.case([3, 1, 0], pad_rows=1, **layout)
    for name in ("q", "block_tables", "query_start_loc", "seq_lens"):
        static[name].copy_(step[name])
    assert step["kv_cache"].shape[1] <= static["kv_cache"].shape[1]
    static["kv_cache"][:, : step["kv_cache"].shape[1]].copy_(step["kv_cache"])
    graph.replay()
    torch.cuda.synchronize()
    want, want_lse = run_split(step, keys)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


@gpu
@needs_cuda
@pytest.mark.parametrize("window", [None, 1000])
def test_gpu_merging_in_the_launch_gives_the_two_launches_bits(window):
    """`split_merge` compiled, where programs of a row race to store their partials:
    Qwen3-8B's shape in bfloat16, contexts 1 to 8192 (one split to 32) and 5 padding rows,
    grids from the real lengths, a graph's bound and one program per row: the two
    launches' output and lse bit for bit in 30 repeats each, then replayed 30 times from a
    CUDA graph; the counters zero after every call."""
    contexts = [1, 17, 255, 256, 257, 640, 1000, 2048, 4095, 4096, 5000, 8192]
    rows = Rows(contexts, seed=91, **REAL)
    keys = DECODE_KEYS_PER_SPLIT
    case = rows.case(
        range(len(contexts)), page=16, window=window, q_dtype=torch.bfloat16, pad_rows=5
    )
    for kwargs in ({}, dict(max_seq_len=40960), dict(grid_splits=1)):
        want = run_split(case, keys, merge_in_launch=False, **kwargs)
        for _ in range(30):
            got = run_merged(case, keys, **kwargs)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), kwargs
    out = torch.empty_like(case["q"])
    lse = torch.empty(case["q"].shape[:2], device=DEVICE)
    counters = torch.zeros(case["q"].shape[0], case["kv_cache"].shape[3], dtype=torch.int32)
    counters = counters.to(DEVICE)

    def launch():
        paged_attention_decode_split_triton(
            **case, max_seq_len=8192, out=out, lse=lse, merge_in_launch=True, counters=counters
        )

    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    want = run_split(case, keys, merge_in_launch=False, max_seq_len=8192)
    for _ in range(30):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
        assert not counters.any()
