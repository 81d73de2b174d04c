"""The Triton MLA kernel (kernels/mla_attention_triton.py) against `mla_attention_ref`.

Without CUDA the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set by the
conftests) at tiny widths (r = 32, dr = 16; 4 to 20 heads; 4- and 16-token pages); with
CUDA the same tests run compiled, and the `gpu`-marked ones add Kimi-Linear's shape
(r = 512, dr = 64, 32 heads and 16 for TP = 2, bfloat16, 16-token pages), a CUDA-graph
replay and the routing of `ops.mla_attention`.

Inputs are fresh normal values. Caches are poisoned as the sanitizer does: slots past a
row's context, unused pages and the null page (which unused table entries point at) hold
NaN, and outputs start as NaN, so a read of a key a row must not see, or an element left
unwritten, fails.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from kvloom.kernels import ops
from kvloom.kernels.kv_cache_write import FP8_DTYPE, quantize_kv
from kvloom.kernels.mla_attention import mla_attention_ref
from kvloom.kernels.mla_attention_triton import mla_attention_triton, mla_plan
from tests.kernel_env import CUDA, DEVICE, gpu, needs_cuda

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# As in test_paged_attention_dcp_triton.py: only when triton was imported for the compiler
# before the conftests could choose the interpreter (never under the suite's root conftest).
pytestmark = pytest.mark.skipif(
    not CUDA and not INTERPRETED,
    reason="triton was imported for the compiler first and there is no GPU",
)

RANK, ROPE = 32, 16
# (atol, rtol) by q's dtype. float32 runs float32 dots (an FP8 or half cache widened
# exactly), so it matches the float32 reference to rounding; bfloat16 adds the rounding
# of P to bfloat16 for P @ V and of the output (2^-9 relative each).
ATTN_TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (1e-2, 1e-2)}
LSE_TOL = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (1e-3, 1e-5)}

# (query_len, context_len): decodes at and across page / tile boundaries, a whole prefill,
# a chunk resuming a prefill, one-token first chunks, zero-length rows, a long decode over
# several tiles and a chunk whose context crosses many pages.
MIXED_ROWS = [
    (1, 1),
    (1, 5),
    (1, 16),
    (1, 17),
    (9, 9),
    (5, 21),
    (0, 6),
    (1, 1),
    (0, 0),
    (1, 70),
    (13, 40),
]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def check_close(name, actual, expected, atol, rtol):
    """assert_close plus the error it saw; infinities (rows without keys) must match."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert not torch.isnan(a).any(), f"{name}: NaN in the kernel's output"
    diff = (a - e)[torch.isfinite(e)]
    print(f"ERRNORM {name}: max_abs={diff.abs().max().item() if diff.numel() else 0.0:.3e}")
    torch.testing.assert_close(a, e, atol=atol, rtol=rtol, equal_nan=False)


def make_rows(rows, *, heads, rank=RANK, rope=ROPE, seed=0, key_scale=1.0):
    """Per row: its cache rows [context, r + dr] in position order, and its queries
    q_latent [q_len, H, r], q_pe [q_len, H, dr] (float32, on the CPU)."""
    g = gen(seed)
    out = []
    for q_len, ctx in rows:
        keys = torch.randn(ctx, rank + rope, generator=g) * key_scale
        out.append(
            (
                keys,
                torch.randn(q_len, heads, rank, generator=g),
                torch.randn(q_len, heads, rope, generator=g),
            )
        )
    return out


def lay_out(rows, parts, *, page, seed=0, tail=2, dtype=torch.float32, cache_dtype=None, **kw):
    """The kernel's arguments: each row's keys in shuffled pages of a NaN-filled cache
    (page 0 is the null page every unused table entry points at), its queries packed in
    row order, then `tail` random padding tokens past query_start_loc[-1]."""
    cache_dtype = cache_dtype or dtype
    kv_scale = kw.get("kv_scale", 1.0)
    rank, rope = parts[0][1].shape[2], parts[0][2].shape[2]
    heads = parts[0][1].shape[1]
    need = [math.ceil(ctx / page) for _, ctx in rows]
    num_pages = sum(need) + 2  # + the null page and one never-used page
    cache = torch.full((num_pages, page, rank + rope), float("nan"))
    order = (torch.randperm(num_pages - 1, generator=gen(seed + 100)) + 1).tolist()
    tables = torch.zeros(len(rows), max(need, default=0) + 1, dtype=torch.int32)
    for i, (keys, _, _) in enumerate(parts):
        for b in range(need[i]):
            pid = order.pop()
            chunk = keys[b * page : (b + 1) * page]
            cache[pid, : chunk.shape[0]] = chunk
            tables[i, b] = pid
    g = gen(seed + 200)
    q_latent = torch.cat([p[1] for p in parts] + [torch.randn(tail, heads, rank, generator=g)])
    q_pe = torch.cat([p[2] for p in parts] + [torch.randn(tail, heads, rope, generator=g)])
    qsl = [0]
    for q_len, _ in rows:
        qsl.append(qsl[-1] + q_len)
    case = dict(
        q_latent=q_latent.to(dtype=dtype, device=DEVICE),
        q_pe=q_pe.to(dtype=dtype, device=DEVICE),
        latent_cache=quantize_kv(cache, cache_dtype, kv_scale).to(DEVICE),
        block_tables=tables.to(DEVICE),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([c for _, c in rows], dtype=torch.int32, device=DEVICE),
        scale=kw.get("scale", 0.2),
        kv_scale=kv_scale,
    )
    return case


def run_kernel(case, plan=None):
    """The kernel into NaN-filled outputs (an element it forgets to write stays NaN)."""
    q = case["q_latent"]
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)
    got = mla_attention_triton(**case, out=out, lse=lse, _plan_override=plan)
    assert got[0] is out and got[1] is lse
    return out, lse


def check_case(name, case, plan=None):
    out, lse = run_kernel(case, plan)
    ref_out, ref_lse = mla_attention_ref(**case)
    dtype = case["q_latent"].dtype
    check_close(name + " out", out, ref_out, *ATTN_TOL[dtype])
    check_close(name + " lse", lse, ref_lse, *LSE_TOL[dtype])
    return out, lse


# ------------------------------------------------------------------------------ CPU tests


@pytest.mark.parametrize(("heads", "page"), [(8, 4), (4, 16), (20, 4)])
def test_mixed_rows_match_reference(heads, page):
    """Decodes, prefill chunks, one-token first chunks, zero-length rows and padding in
    one launch, under the model-shape plan: 8 heads pack 2 tokens per program, 4 heads 4,
    20 heads split into a full and a partial head block of 16."""
    parts = make_rows(MIXED_ROWS, heads=heads, seed=heads + page)
    case = lay_out(MIXED_ROWS, parts, page=page, seed=page)
    out, lse = check_case(f"h{heads} p{page}", case)
    # Padding tokens past the last row: rows without keys.
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))
    assert torch.isneginf(lse[-2:]).all()


@pytest.mark.parametrize(
    "plan",
    [
        # 2 heads x 8 tokens a program, 4 head blocks
        dict(HEAD_BLOCK=2, BLOCK_M=16, BLOCK_Q=8, TILE=16, num_warps=4, num_stages=2),
        # head blocks that do not divide the heads (3, 3, 2), 5 tokens, one unused tile row
        dict(HEAD_BLOCK=3, BLOCK_M=16, BLOCK_Q=5, TILE=32, num_warps=4, num_stages=2),
        # one head a program, taller than needed
        dict(HEAD_BLOCK=1, BLOCK_M=32, BLOCK_Q=32, TILE=16, num_warps=4, num_stages=2),
    ],
    ids=["hb2", "hb3", "hb1"],
)
def test_head_block_splits(plan):
    rows = [(1, 70), (7, 19), (0, 3), (1, 2), (33, 33)]
    parts = make_rows(rows, heads=8, seed=7)
    check_case(f"plan {plan['HEAD_BLOCK']}", lay_out(rows, parts, page=4, seed=3), plan)


def test_widths_not_powers_of_two_are_padded_each():
    """r = 24 and dr = 8 are padded separately (to 32 and 16), never to their sum's."""
    rows = [(1, 9), (4, 12), (0, 1), (1, 1)]
    parts = make_rows(rows, heads=4, rank=24, rope=8, seed=5)
    check_case("r24 dr8", lay_out(rows, parts, page=4, seed=5))


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, FP8_DTYPE),
        (torch.bfloat16, FP8_DTYPE),
    ],
)
def test_cache_dtypes(dtype, cache_dtype):
    """bfloat16, and FP8 pages (kv_scale folded into the score scale and the output):
    against the reference reading the same pages."""
    rows = [(1, 1), (1, 18), (6, 6), (3, 11), (0, 2), (1, 33)]
    parts = make_rows(rows, heads=8, seed=9, key_scale=3.0)
    fp8 = cache_dtype == FP8_DTYPE
    case = lay_out(
        rows,
        parts,
        page=4,
        seed=9,
        dtype=dtype,
        cache_dtype=cache_dtype,
        kv_scale=0.6 if fp8 else 1.0,
    )
    check_case(f"q {dtype} cache {cache_dtype}", case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("target", [(1, 37), (11, 30), (1, 1)], ids=["decode", "chunk", "first"])
def test_row_alone_equals_row_among_others_bitwise(dtype, target):
    """A row's output and lse do not depend on what else is batched: alone, and between
    decodes and prefill chunks (other tokens before and after it, other pages), bit for
    bit."""
    others = [(1, 9), (17, 40), (0, 4), (1, 64), (5, 5)]
    parts = make_rows([target] + others, heads=8, seed=21)
    alone = run_kernel(lay_out([target], parts[:1], page=4, seed=1, dtype=dtype))
    rows = others[:3] + [target] + others[3:]
    mixed_parts = parts[1:4] + parts[:1] + parts[4:]
    mixed = run_kernel(lay_out(rows, mixed_parts, page=4, seed=2, dtype=dtype))
    first = sum(q for q, _ in others[:3])
    span = slice(first, first + target[0])
    assert torch.equal(mixed[0][span], alone[0][: target[0]])
    assert torch.equal(mixed[1][span], alone[1][: target[0]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunk_equals_its_tokens_as_decodes_bitwise(dtype):
    """One plan for every row, tiles on absolute positions: a token computed inside a
    prefill chunk (sharing a program with its neighbours) equals the same token computed
    as a decode row, bit for bit (what the deterministic mode needs)."""
    ctx, q_len = 45, 13
    ((keys, q_lat, q_pe),) = make_rows([(q_len, ctx)], heads=8, seed=31)
    chunk = run_kernel(lay_out([(q_len, ctx)], [(keys, q_lat, q_pe)], page=4, dtype=dtype))
    rows = [(1, ctx - q_len + 1 + j) for j in range(q_len)]
    parts = [(keys[:c], q_lat[j : j + 1], q_pe[j : j + 1]) for j, (_, c) in enumerate(rows)]
    decodes = run_kernel(lay_out(rows, parts, page=4, seed=4, dtype=dtype))
    assert torch.equal(chunk[0][:q_len], decodes[0][:q_len])
    assert torch.equal(chunk[1][:q_len], decodes[1][:q_len])


def test_plan_depends_on_the_model_shape_only():
    assert mla_plan(32, torch.bfloat16)["HEAD_BLOCK"] == 16  # 2 programs per decode row
    assert mla_plan(16, torch.bfloat16) == dict(
        HEAD_BLOCK=16, BLOCK_M=16, BLOCK_Q=1, TILE=32, num_warps=8, num_stages=2
    )
    assert mla_plan(8, torch.bfloat16)["BLOCK_Q"] == 2


def test_ops_routes_to_the_mla_kernel(monkeypatch):
    """`ops.mla_attention` on the Triton path calls this kernel, not the generic paged
    kernel over `latent_cache_as_kv` (interpreted here by pretending Triton applies)."""
    import kvloom.kernels.paged_attention_triton as generic

    def forbidden(*args, **kwargs):
        raise AssertionError("mla_attention fell back to another kernel")

    monkeypatch.setattr(ops, "use_triton", lambda tensor: True)
    monkeypatch.setattr(ops, "mla_attention_ref", forbidden)
    monkeypatch.setattr(generic, "paged_attention_triton", forbidden)
    rows = [(1, 6), (3, 3)]
    case = lay_out(rows, make_rows(rows, heads=4, seed=2), page=4, tail=0)
    got = ops.mla_attention(**case)
    monkeypatch.undo()
    want, _ = mla_attention_ref(**case)
    check_close("ops route", got, want, *ATTN_TOL[torch.float32])


def test_rejects_bad_arguments():
    rows = [(1, 3)]
    case = lay_out(rows, make_rows(rows, heads=4, seed=1), page=4)
    with pytest.raises(ValueError, match="q_pe"):
        mla_attention_triton(**dict(case, q_pe=case["q_pe"][:, :2]))
    with pytest.raises(ValueError, match="latent_cache"):
        mla_attention_triton(**dict(case, latent_cache=case["latent_cache"][..., :-1]))
    with pytest.raises(ValueError, match="latent_cache: dtype"):  # a float32 cache, half q
        mla_attention_triton(**dict(case, q_latent=case["q_latent"].bfloat16()))
    with pytest.raises(ValueError, match="latent_cache: dtype"):  # a half cache, float32 q
        mla_attention_triton(**dict(case, latent_cache=case["latent_cache"].bfloat16()))
    with pytest.raises(ValueError, match="kv_scale"):
        mla_attention_triton(**dict(case, kv_scale=0.0))
    with pytest.raises(ValueError, match="query_start_loc"):
        mla_attention_triton(**dict(case, query_start_loc=case["query_start_loc"][:1]))


# ------------------------------------------------------------------------------ GPU tests

KIMI = dict(rank=512, rope=64)
KIMI_SCALE = (128 + 64) ** -0.5  # qk_nope_head_dim 128 + qk_rope_head_dim 64


def kimi_rows(seed: int, decodes: int, prefills: int, max_ctx: int):
    """Decodes up to max_ctx, prefill chunks over a prefix, and edge rows."""
    g = gen(seed)
    rows = [(1, int(torch.randint(1, max_ctx + 1, (1,), generator=g))) for _ in range(decodes)]
    for _ in range(prefills):
        q_len = int(torch.randint(1, 300, (1,), generator=g))
        rows.append((q_len, q_len + int(torch.randint(0, 1000, (1,), generator=g))))
    return rows + [(1, max_ctx), (1, 1), (1, 17), (16, 16), (0, 40)]


@gpu
@needs_cuda
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
@pytest.mark.parametrize("heads", [32, 16])  # Kimi-Linear at TP = 1 and TP = 2
def test_gpu_kimi_shape_matches_reference(heads, cache_dtype):
    """Kimi-Linear's MLA shape in bfloat16 over 16-token pages, contexts up to 4096:
    within (1e-2, 1e-2) of the float32 reference (bfloat16 P and output rounding), lse
    within 1e-3; and a row alone equals the same row in the batch, bit for bit."""
    rows = kimi_rows(seed=heads, decodes=24, prefills=3, max_ctx=4096)
    parts = make_rows(rows, heads=heads, seed=heads, **KIMI)
    fp8 = cache_dtype == FP8_DTYPE
    layout = dict(page=16, dtype=torch.bfloat16, cache_dtype=cache_dtype, scale=KIMI_SCALE)
    case = lay_out(rows, parts, kv_scale=0.05 if fp8 else 1.0, **layout)
    out, lse = check_case(f"kimi h{heads} {cache_dtype}", case)
    i = 5  # a decode row, alone
    alone = run_kernel(
        lay_out(rows[i : i + 1], parts[i : i + 1], seed=8, **layout, kv_scale=case["kv_scale"])
    )
    assert torch.equal(out[i], alone[0][0]) and torch.equal(lse[i], alone[1][0])


@gpu
@needs_cuda
def test_gpu_ops_mla_attention_replays_in_a_cuda_graph(monkeypatch):
    """The layer's call (ops.mla_attention, decode rows, Kimi's shape) captured once, then
    replayed over new queries and longer contexts in the captured buffers: equal to eager,
    bit for bit, within tolerance of the reference, and never through the generic kernel."""
    import kvloom.kernels.paged_attention_triton as generic

    def forbidden(*args, **kwargs):
        raise AssertionError("mla_attention on CUDA did not take the MLA kernel")

    monkeypatch.setattr(ops, "mla_attention_ref", forbidden)
    monkeypatch.setattr(generic, "paged_attention_triton", forbidden)
    rows = [row for row in kimi_rows(seed=3, decodes=40, prefills=0, max_ctx=2048) if row[0] <= 1]
    parts = make_rows(rows, heads=32, seed=3, **KIMI)
    case = lay_out(rows, parts, page=16, tail=0, dtype=torch.bfloat16, scale=KIMI_SCALE)
    full_lens = case["seq_lens"].clone()
    case["seq_lens"] = torch.clamp(full_lens - 7, min=1).to(torch.int32)

    def step():
        return ops.mla_attention(**case)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()

    case["q_latent"].copy_(torch.randn(case["q_latent"].shape, generator=gen(99)).to(DEVICE))
    case["seq_lens"].copy_(full_lens)
    graph.replay()
    torch.cuda.synchronize()
    eager_out = step()
    assert torch.equal(graph_out, eager_out)
    monkeypatch.undo()
    ref_out, _ = mla_attention_ref(**case)
    check_close("graph replay", graph_out, ref_out, *ATTN_TOL[torch.bfloat16])
