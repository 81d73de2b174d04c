"""The Triton paged-attention kernel on a decode-context-parallel shard (kv_stride > 1)
against `paged_attention_ref`, and the shards' merge against the whole-cache kernel.

A DCP rank of S holds the positions `offset + i * S` of every row at local index i; its
block table indexes local tokens, while query positions and `seq_lens` stay global. The
cases below build one set of keys and values per row and lay it out twice: whole (stride
1) and as each rank's share, so the log-sum-exp merge of all shards
(`merge_attention_states_ref`) must give the whole-cache answer.

Without CUDA the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set by the
conftests) at tiny shapes; with CUDA the same tests run compiled, and the `gpu`-marked ones
add real shapes, a CUDA-graph capture of a shard launch and a no-recompile-per-rank check.

Caches are poisoned as the sanitizer does: unused pages, slots past a shard's last local
token and pages wholly before the window hold NaN, and outputs start as NaN, so a read of
a key the shard must not see, or an element left unwritten, fails.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from kvloom.kernels import ops
from kvloom.kernels.kv_cache_write import FP8_DTYPE, quantize_kv
from kvloom.kernels.merge_attention_states import merge_attention_states_ref
from kvloom.kernels.paged_attention import paged_attention_ref
from kvloom.kernels.paged_attention_triton import paged_attention_triton
from tests.kernel_env import CUDA, DEVICE, gpu, needs_cuda

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# As in test_kv_cache_fp8_triton.py: only when triton was imported for the compiler before
# the conftests could choose the interpreter (never under the suite's root conftest).
pytestmark = pytest.mark.skipif(
    not CUDA and not INTERPRETED,
    reason="triton was imported for the compiler first and there is no GPU",
)

# (atol, rtol) by q's dtype. A float32 q runs float32 dots whatever the cache holds (a half
# or FP8 cache is widened exactly), so it matches the float32 reference to rounding.
ATTN_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}
LSE_TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (1e-4, 1e-5), torch.bfloat16: (1e-4, 1e-5)}

# (query_len, context_len): decodes at and around page and shard boundaries, a whole
# prefill from position 0 (its first queries see nothing on ranks > 0), a chunk resuming a
# prefill, a one-token first chunk, zero-length rows, rows without context, a long decode
# whose share crosses several 16-key tiles, and a long chunk crossing query blocks.
MIXED_ROWS = [
    (1, 1),
    (1, 2),
    (1, 5),
    (1, 8),
    (1, 17),
    (9, 9),
    (5, 21),
    (0, 6),
    (0, 0),
    (2, 0),
    (1, 130),
    (23, 45),
]
SMALL_PLAN = {"BLOCK_M": 16, "BLOCK_Q": 8, "TILE": 16, "DIM_PAD": 16}
SMALL_PLAN.update(num_warps=4, num_stages=2)  # for group 2, head_dim 16


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def check_close(name, actual, expected, atol, rtol):
    """assert_close plus the error it saw; infinities (empty rows) must match exactly."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert not torch.isnan(a).any(), f"{name}: NaN in the kernel's output"
    diff = (a - e)[torch.isfinite(e)]
    print(f"ERRNORM {name}: max_abs={diff.abs().max().item() if diff.numel() else 0.0:.3e}")
    torch.testing.assert_close(a, e, atol=atol, rtol=rtol, equal_nan=False)


def make_rows(rows, *, num_kv_heads, group, head_dim, seed, tail=2):
    """Fresh queries [tokens + tail, Hq, D] (tail: padding tokens past the last row) and
    each row's keys / values [2, context, Hkv, D] in position order, float32 on the CPU."""
    g = gen(seed)
    kvs = [torch.randn(2, ctx, num_kv_heads, head_dim, generator=g) for _, ctx in rows]
    total = sum(q_len for q_len, _ in rows)
    q = torch.randn(total + tail, num_kv_heads * group, head_dim, generator=g)
    return q, kvs


def lay_out(rows, q, kvs, *, page, kv_stride=1, kv_offset=0, window=None, **dtypes):
    """One rank's kernel arguments: its share of every row's keys, in shuffled pages.

    dtypes: q_dtype and cache_dtype (default float32); k_scale / v_scale for an FP8 cache.
    Table entries a row does not need, and pages wholly before the local index of its
    first query's window start, point at an all-NaN page; slots past the share's last
    local token are NaN.
    """
    q_dtype = dtypes.get("q_dtype", torch.float32)
    cache_dtype = dtypes.get("cache_dtype", torch.float32)
    k_scale, v_scale = dtypes.get("k_scale", 1.0), dtypes.get("v_scale", 1.0)
    shares = [kv[:, kv_offset::kv_stride] for kv in kvs]
    need = [max(1, math.ceil(share.shape[1] / page)) for share in shares]
    num_pages = sum(need) + 1
    head_dim = q.shape[2]
    num_kv_heads = kvs[0].shape[2]
    cache = torch.full((2, num_pages, page, num_kv_heads, head_dim), float("nan"))
    poison = num_pages - 1
    order = torch.randperm(num_pages - 1, generator=gen(10 * kv_stride + kv_offset)).tolist()
    tables = torch.full((len(rows), max(need) + 1), poison, dtype=torch.int32)
    for i, ((q_len, ctx), share) in enumerate(zip(rows, shares, strict=True)):
        first_pos = 0 if window is None else max(0, ctx - q_len - window + 1)
        first_local = max(0, -(-(first_pos - kv_offset) // kv_stride))
        for b in range(math.ceil(share.shape[1] / page)):
            pid = order.pop()
            chunk = share[:, b * page : (b + 1) * page]
            cache[:, pid, : chunk.shape[1]] = chunk
            if (b + 1) * page > first_local:  # else freed by the window: stays poisoned
                tables[i, b] = pid
    keys = quantize_kv(cache[0], cache_dtype, k_scale)  # a plain cast unless FP8
    values = quantize_kv(cache[1], cache_dtype, v_scale)
    qsl = [0]
    for q_len, _ in rows:
        qsl.append(qsl[-1] + q_len)
    case = dict(
        q=q.to(dtype=q_dtype, device=DEVICE),
        kv_cache=torch.stack([keys, values]).to(DEVICE),
        block_tables=tables.to(DEVICE),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([c for _, c in rows], dtype=torch.int32, device=DEVICE),
        scale=head_dim**-0.5,
        sliding_window=window,
        kv_stride=kv_stride,
        kv_offset=kv_offset,
    )
    if cache_dtype == FP8_DTYPE:
        case.update(k_scale=k_scale, v_scale=v_scale)
    return case


def shard_cases(rows, q, kvs, dcp, *, page, shard_page=None, **layout):
    """The whole-cache case and one case per DCP rank of `dcp` (pages of shard_page local
    tokens, default page)."""
    whole = lay_out(rows, q, kvs, page=page, **layout)
    shard_page = shard_page or page
    shards = [
        lay_out(rows, q, kvs, page=shard_page, kv_stride=dcp, kv_offset=r, **layout)
        for r in range(dcp)
    ]
    return whole, shards


def run_kernel(case, num_kv_splits=1, plan=None, out_dtype=None):
    """The kernel into NaN-filled outputs (an element it forgets to write stays NaN)."""
    q = case["q"]
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)
    got = paged_attention_triton(
        **case, num_kv_splits=num_kv_splits, out=out, lse=lse, _plan_override=plan
    )
    assert got[0] is out and got[1] is lse
    return out, lse


def merge(results):
    outs = torch.stack([o.float() for o, _ in results])
    lses = torch.stack([lse for _, lse in results])
    return merge_attention_states_ref(outs, lses)


def check_shards(name, whole, shards, num_kv_splits=1, plan=None):
    """Each shard against the reference; their merge against the whole-cache kernel and
    the whole-cache reference. Returns the shards' results."""
    dtype = whole["q"].dtype
    results = []
    for shard in shards:
        got = run_kernel(shard, num_kv_splits, plan)
        ref_out, ref_lse = paged_attention_ref(**shard)
        tag = f"{name} rank {shard['kv_offset']}/{shard['kv_stride']}"
        check_close(tag + " out", got[0], ref_out, *ATTN_TOL[dtype])
        check_close(tag + " lse", got[1], ref_lse, *LSE_TOL[dtype])
        results.append(got)
    merged_out, merged_lse = merge(results)
    whole_out, whole_lse = run_kernel(whole, num_kv_splits, plan)
    check_close(name + " merged out", merged_out, whole_out, *ATTN_TOL[dtype])
    check_close(name + " merged lse", merged_lse, whole_lse, *LSE_TOL[dtype])
    ref_out, ref_lse = paged_attention_ref(**whole)
    check_close(name + " merged out vs ref", merged_out, ref_out, *ATTN_TOL[dtype])
    check_close(name + " merged lse vs ref", merged_lse, ref_lse, *LSE_TOL[dtype])
    return results


# ------------------------------------------------------------------------------ CPU tests


@pytest.mark.parametrize(("dcp", "window"), [(2, None), (2, 3), (4, 1), (4, 6)])
def test_shards_match_reference_and_merge_to_whole(dcp, window):
    """Every offset of DCP 2 and 4, prefill / decode / empty rows in one launch pair, a
    window crossing shard boundaries (1: a query sees itself only, on one rank)."""
    q, kvs = make_rows(MIXED_ROWS, num_kv_heads=2, group=2, head_dim=16, seed=dcp + (window or 0))
    whole, shards = shard_cases(MIXED_ROWS, q, kvs, dcp, page=4, window=window)
    check_shards(f"dcp{dcp} w{window}", whole, shards)


@pytest.mark.parametrize(("num_kv_splits", "page"), [(1, 1), (2, 4)])
def test_shards_small_tiles_split_kv_and_one_token_pages(num_kv_splits, page):
    """Small query blocks / key tiles (one plan for every row, as the deterministic mode
    does), split-KV inside a shard, and one-token pages."""
    rows = [(1, 130), (19, 40), (1, 3), (0, 2)]
    q, kvs = make_rows(rows, num_kv_heads=2, group=2, head_dim=16, seed=40 + page)
    whole, shards = shard_cases(rows, q, kvs, 4, page=page, window=7)
    check_shards(f"small tiles s{num_kv_splits} p{page}", whole, shards, num_kv_splits, SMALL_PLAN)


@pytest.mark.parametrize(
    ("q_dtype", "cache_dtype"),
    [
        (torch.float32, torch.bfloat16),  # the DCP layer's float32 partials over its cache
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_shards_half_caches(q_dtype, cache_dtype):
    rows = MIXED_ROWS
    q, kvs = make_rows(rows, num_kv_heads=2, group=2, head_dim=16, seed=7)
    layout = dict(page=4, window=5, q_dtype=q_dtype, cache_dtype=cache_dtype)
    whole, shards = shard_cases(rows, q, kvs, 2, **layout)
    results = check_shards(f"q {q_dtype} cache {cache_dtype}", whole, shards)
    if q_dtype == torch.float32:
        # The merged float32 partials against one rank of today's half kernel (DCP = 1
        # with the half q): equal to that kernel's own rounding.
        half_whole = dict(whole, q=q.to(dtype=cache_dtype, device=DEVICE))
        half_out, _ = run_kernel(half_whole)
        merged_out, _ = merge(results)
        check_close(
            "merged vs the half kernel", merged_out, half_out.float(), *ATTN_TOL[cache_dtype]
        )


@pytest.mark.parametrize(("dcp", "q_dtype"), [(2, torch.float32), (4, torch.bfloat16)])
def test_shards_fp8_cache_with_scales(dcp, q_dtype):
    q, kvs = make_rows(MIXED_ROWS, num_kv_heads=2, group=2, head_dim=16, seed=11 + dcp)
    layout = dict(page=4, window=6, q_dtype=q_dtype, cache_dtype=FP8_DTYPE)
    whole, shards = shard_cases(MIXED_ROWS, q, kvs, dcp, k_scale=0.5, v_scale=2.0, **layout)
    check_shards(f"fp8 dcp{dcp} {q_dtype}", whole, shards)


def test_empty_shares_give_zero_and_minus_infinity():
    """Rows whose share on a rank is empty (context shorter than the rank's offset, no
    context, no queries) and queries at positions before any of the rank's keys: output
    exactly 0 and lse -inf, on every rank that holds nothing they can see."""
    rows = [(1, 1), (1, 2), (0, 3), (2, 0), (3, 3)]
    q, kvs = make_rows(rows, num_kv_heads=1, group=2, head_dim=16, seed=3)
    for rank in range(4):
        out, lse = run_kernel(lay_out(rows, q, kvs, page=4, kv_stride=4, kv_offset=rank))
        # Tokens: row 0 sees position 0, row 1 positions 0..1, row 3 (tokens 2, 3) nothing,
        # row 4's tokens 4..6 sit at positions 0, 1, 2; tokens 7, 8 are padding.
        sees = {0: rank == 0, 1: rank <= 1, 4: rank == 0, 5: rank <= 1, 6: rank <= 2}
        for token in range(q.shape[0]):
            if sees.get(token, False):
                assert torch.isfinite(lse[token]).all(), (rank, token)
            else:
                assert torch.equal(out[token], torch.zeros_like(out[token])), (rank, token)
                assert torch.isneginf(lse[token]).all(), (rank, token)


def test_stride_one_is_the_whole_cache_bitwise():
    """kv_stride 1 / kv_offset 0 is the unstrided kernel, bit for bit."""
    q, kvs = make_rows(MIXED_ROWS, num_kv_heads=2, group=2, head_dim=16, seed=5)
    case = lay_out(MIXED_ROWS, q, kvs, page=4, window=6)
    plain = {k: v for k, v in case.items() if k not in ("kv_stride", "kv_offset")}
    out, lse = run_kernel(case)
    out_plain, lse_plain = paged_attention_triton(**plain)
    assert torch.equal(out, out_plain) and torch.equal(lse, lse_plain)


def test_rejects_bad_shards_and_caches():
    q, kvs = make_rows([(1, 3)], num_kv_heads=2, group=2, head_dim=16, seed=1)
    case = lay_out([(1, 3)], q, kvs, page=4, kv_stride=2, kv_offset=1)
    for stride, offset in ((0, 0), (2, 2), (2, -1), (True, 0), (2, 1.0)):
        with pytest.raises(ValueError, match="kv_stride|kv_offset"):
            paged_attention_triton(**dict(case, kv_stride=stride, kv_offset=offset))
    with pytest.raises(ValueError, match="kv_cache"):  # a float32 cache under a half q
        paged_attention_triton(**dict(case, q=case["q"].bfloat16()))


# ------------------------------------------------------------------------------ GPU tests


def real_rows(seed: int, decodes: int, prefills: int, max_ctx: int):
    """Decodes up to max_ctx, prefill chunks over a prefix, and edge rows."""
    g = gen(seed)
    rows = [(1, int(torch.randint(1, max_ctx + 1, (1,), generator=g))) for _ in range(decodes)]
    for _ in range(prefills):
        q_len = int(torch.randint(1, 600, (1,), generator=g))
        rows.append((q_len, q_len + int(torch.randint(0, 1500, (1,), generator=g))))
    return rows + [(1, max_ctx), (1, 1), (1, 3), (16, 16), (0, 40)]


REAL = dict(num_kv_heads=8, group=4, head_dim=128)  # 32 query heads over 8 (Qwen3-8B)


@gpu
@needs_cuda
@pytest.mark.parametrize(
    ("q_dtype", "cache_dtype"),
    [
        (torch.float32, torch.bfloat16),  # what the DCP layer runs
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.float32, FP8_DTYPE),
    ],
)
@pytest.mark.parametrize("window", [None, 1000])
@pytest.mark.parametrize("dcp", [2, 4])
def test_gpu_dcp_shards_merge_to_whole_real_shapes(dcp, window, q_dtype, cache_dtype):
    """DCP simulated on one GPU: a whole cache of 16-token pages sliced into each rank's
    share (16 / dcp local tokens a page, as the runner lays it out), contexts up to 8k."""
    rows = real_rows(seed=dcp, decodes=24, prefills=3, max_ctx=8192)
    q, kvs = make_rows(rows, **REAL, seed=dcp + (window or 0))
    layout = dict(page=16, window=window, q_dtype=q_dtype, cache_dtype=cache_dtype)
    if cache_dtype == FP8_DTYPE:
        layout.update(k_scale=0.25, v_scale=0.5)
    whole, shards = shard_cases(rows, q, kvs, dcp, shard_page=16 // dcp, **layout)
    check_shards(f"gpu dcp{dcp} w{window} q {q_dtype} cache {cache_dtype}", whole, shards)


@gpu
@needs_cuda
@pytest.mark.parametrize("decode_only", [True, False])
def test_gpu_shard_launch_replays_in_a_cuda_graph(monkeypatch, decode_only):
    """The DCP layer's call (ops.paged_attention, float32 q over a bfloat16 cache, rank 1
    of 2) captured once, then replayed over new queries and longer contexts written into
    the captured buffers: equal to eager, bit for bit. It must take the Triton kernel."""

    def no_reference(*args, **kwargs):
        raise AssertionError("a DCP shard on CUDA fell back to the reference kernel")

    monkeypatch.setattr(ops, "paged_attention_ref", no_reference)
    rows = real_rows(seed=9, decodes=32, prefills=2, max_ctx=4096)
    if decode_only:  # max_query_len=1 then skips the long-row launch: decodes only
        rows = [row for row in rows if row[0] <= 1]
    q, kvs = make_rows(rows, **REAL, seed=9)
    case = lay_out(rows, q, kvs, page=8, kv_stride=2, kv_offset=1, cache_dtype=torch.bfloat16)
    full_lens = case["seq_lens"].clone()
    # Capture at shorter contexts (keys past them are simply not read), replay at full.
    case["seq_lens"] = torch.clamp(full_lens - 7, min=0).to(torch.int32)
    max_query_len = 1 if decode_only else None

    def step():
        return ops.paged_attention(**case, max_query_len=max_query_len)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out, graph_lse = step()

    case["q"].copy_(torch.randn(q.shape, generator=gen(99)).to(DEVICE))
    case["seq_lens"].copy_(full_lens)
    graph.replay()
    torch.cuda.synchronize()
    eager_out, eager_lse = step()
    assert torch.equal(graph_out, eager_out) and torch.equal(graph_lse, eager_lse)
    ref_out, ref_lse = paged_attention_ref(**case)
    check_close("graph replay out", graph_out, ref_out, *ATTN_TOL[torch.float32])
    check_close("graph replay lse", graph_lse, ref_lse, *LSE_TOL[torch.float32])


@gpu
@needs_cuda
def test_gpu_one_compile_serves_every_rank():
    """kv_stride / kv_offset are runtime values: after rank 0 of DCP 2 has compiled its
    launches, every other rank of DCP 2 and 4 reuses them (no compile per rank)."""
    from kvloom.kernels.paged_attention_triton import _paged_attention_kernel

    caches = getattr(_paged_attention_kernel, "device_caches", None)
    assert caches is not None, "Triton's JITFunction has no device_caches to count compiles"
    rows = [(1, 300), (1, 77), (40, 90), (0, 5)]
    q, kvs = make_rows(rows, **REAL, seed=2)
    compiled = None
    for dcp, rank in [(2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)]:
        case = lay_out(rows, q, kvs, page=8, kv_stride=dcp, kv_offset=rank)
        run_kernel(case)
        torch.cuda.synchronize()
        count = len(caches[torch.cuda.current_device()][0])
        compiled = count if compiled is None else compiled
        assert count == compiled, f"DCP {dcp} rank {rank} compiled a new kernel"
