"""The Triton kernels' FP8 KV-cache paths (`kv_cache_dtype="fp8"`) against the torch
references: the KV write (quantize on write, bitwise), paged attention over float8_e4m3fn
pages (dequantize on read), and MLA's latent cache through the same two kernels.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set by the
conftests) at tiny shapes; with CUDA the same tests run compiled, and the `gpu`-marked ones
add real model shapes. The interpreter converts float32 to fp8e4nv by rounding half away
from zero and drops the carry into the exponent (e.g. -124 -> -64), where the GPU's
`cvt.rn.satfinite.e4m3x2.f32` and torch round to nearest even: the conftest's `round_fp8_like_the_gpu`
makes it round as they do, so the bitwise checks mean the same thing in both.

Inputs are fresh normal values, some beyond the e4m3 range (saturated to +-448) and some
NaN (kept NaN); unused pages, slots past a row's context and pages outside a window hold
NaN bytes (0xFF, the sanitizer's fill), so a kernel that reads them fails.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from kvloom.kernels.kv_cache_write import FP8_DTYPE, quantize_kv, write_kv_cache_ref
from kvloom.kernels.kv_cache_write_triton import write_kv_cache_triton
from kvloom.kernels.mla_attention import mla_attention_ref, write_mla_cache_ref
from kvloom.kernels.ops import latent_cache_as_kv
from kvloom.kernels.paged_attention import paged_attention_ref
from kvloom.kernels.paged_attention_triton import paged_attention_triton
from tests.kernel_env import CUDA, DEVICE, gpu, needs_cuda

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# As in test_kernels_triton_dense.py: set when triton was imported for the compiler before
# the conftests could choose the interpreter (never under the suite's root conftest).
pytestmark = pytest.mark.skipif(
    not CUDA and not INTERPRETED,
    reason="triton was imported for the compiler first and there is no GPU",
)
# (atol, rtol) of outputs: the reference dequantizes in float32; the kernel widens the
# pages exactly to q's dtype, folds k_scale into the score scale and v_scale into the
# output, so float32 differs by rounding only and half q types by their P @ V rounding.
ATTN_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}
LSE_TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (1e-4, 1e-5), torch.bfloat16: (1e-4, 1e-5)}
NAN_BYTE = 0xFF


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def check_close(name, actual, expected, atol, rtol):
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert not torch.isnan(a).any(), f"{name}: NaN in the kernel's output"
    diff = (a - e)[torch.isfinite(e)]
    print(f"ERRNORM {name}: max_abs={diff.abs().max().item() if diff.numel() else 0.0:.3e}")
    torch.testing.assert_close(a, e, atol=atol, rtol=rtol, equal_nan=False)


def test_interpreter_reads_every_e4m3_value_exactly():
    """Widening fp8 -> float32 in a kernel gives torch's value for all 256 bytes."""
    import triton
    import triton.language as tl

    @triton.jit
    def widen(src, dst):
        offs = tl.arange(0, 256)
        tl.store(dst + offs, tl.load(src + offs).to(tl.float32))

    raw = torch.arange(256, dtype=torch.uint8, device=DEVICE).view(FP8_DTYPE)
    out = torch.empty(256, device=DEVICE)
    widen[(1,)](raw, out)
    want = raw.float()
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out.nan_to_num(), want.nan_to_num())


# ------------------------------------------------------------------------------- KV write


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("page", "k_scale", "v_scale"), [(1, 1.0, 1.0), (4, 0.3, 2.5), (5, 1.7, 0.05)]
)
def test_write_kv_cache_fp8_is_the_reference_bitwise(dtype, page, k_scale, v_scale):
    tokens, heads, dim, pages = 9, 2, 12, 12
    # key/value as non-contiguous slices of a fused qkv projection, some values past 448
    qkv = torch.randn(tokens, 3 * heads, dim, generator=gen(page)) * 60
    qkv[0, heads, 0] = float("nan")
    qkv[2, 2 * heads, 3] = 5000.0
    qkv[3, heads + 1, 1] = -5000.0
    qkv = qkv.to(dtype=dtype, device=DEVICE)
    key, value = qkv[:, heads : 2 * heads], qkv[:, 2 * heads :]
    slots = torch.randperm(pages * page, generator=gen(page))[:tokens]
    slots[[1, 6]] = -1  # padding tokens
    slots = slots.to(DEVICE)
    start = torch.randint(0, 255, (2, pages, page, heads, dim), generator=gen(9), dtype=torch.uint8)
    cache = start.to(DEVICE).view(FP8_DTYPE)
    expected = cache.clone()
    write_kv_cache_ref(key, value, expected, slots, k_scale, v_scale)
    write_kv_cache_triton(key, value, cache, slots.to(torch.int32), k_scale, v_scale)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    written = expected.float()[0].flatten(0, 1)[slots[slots >= 0].long()]
    assert written.isnan().any() and (written.abs() == 448).any()  # NaN kept, saturated


def test_write_kv_cache_fp8_rejects_bad_scales():
    key = torch.randn(2, 1, 8, device=DEVICE)
    cache = torch.zeros(2, 2, 4, 1, 8, dtype=FP8_DTYPE, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="k_scale"):
            write_kv_cache_triton(key, key, cache, slots, bad, 1.0)
    with pytest.raises(ValueError, match="kv_cache"):
        write_kv_cache_triton(key, key, cache.view(torch.int8), slots)


# ------------------------------------------------------------------------------ attention


def fp8_paged_case(
    rows, *, num_kv_heads, group, head_dim, page, dtype, k_scale, v_scale, window=None, seed=0
):
    """rows: (query_len, context_len). Pages shuffled; table entries a row does not need,
    pages wholly before a window and slots past a row's context hold NaN bytes."""
    g = gen(seed)
    need = [max(1, math.ceil(ctx / page)) for _, ctx in rows]
    num_pages = sum(need) + 2
    values = torch.randn(2, num_pages, page, num_kv_heads, head_dim, generator=g) * 4
    values[0] *= k_scale
    values[1] *= v_scale
    kv = torch.stack(
        [quantize_kv(values[i], FP8_DTYPE, s) for i, s in ((0, k_scale), (1, v_scale))]
    )
    raw = kv.view(torch.uint8)
    poison = num_pages - 1
    raw[:, poison] = NAN_BYTE
    order = torch.randperm(num_pages - 1, generator=g).tolist()
    tables = torch.full((len(rows), max(need) + 1), poison, dtype=torch.int32)
    for i, (q_len, ctx) in enumerate(rows):
        used = math.ceil(ctx / page)
        first_visible = 0 if window is None else max(0, ctx - q_len - window + 1)
        for b in range(used):
            pid = order.pop()
            tables[i, b] = poison if (b + 1) * page <= first_visible else pid
            if b == used - 1 and ctx % page:
                raw[:, pid, ctx % page :] = NAN_BYTE
    q = torch.randn(sum(r[0] for r in rows), num_kv_heads * group, head_dim, generator=g)
    qsl = torch.tensor([0] + [r[0] for r in rows]).cumsum(0)
    return dict(
        q=q.to(dtype=dtype, device=DEVICE),
        kv_cache=kv.to(DEVICE),
        block_tables=tables.to(DEVICE),
        query_start_loc=qsl.to(dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([c for _, c in rows], dtype=torch.int32, device=DEVICE),
        scale=head_dim**-0.5,
        sliding_window=window,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def mixed_rows(page):
    """Decodes at block boundaries, a full prefill, a chunk resuming a prefill, a
    zero-length row and a row without context."""
    return [
        (1, 1),
        (1, page),
        (1, page + 1),
        (page + 2, page + 2),
        (3, 2 * page + 1),
        (0, 5),
        (2, 0),
    ]


def small_plan(group, head_dim):
    block_m = max(16, 1 << (group - 1).bit_length())
    dim_pad = max(16, 1 << (head_dim - 1).bit_length())
    return {"BLOCK_M": block_m, "BLOCK_Q": block_m // group, "TILE": 16, "DIM_PAD": dim_pad}


def check_fp8_attention(name, case, num_kv_splits=1, plan=None):
    q = case["q"]
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)
    plan = None if plan is None else {**plan, "num_warps": 4, "num_stages": 2}
    paged_attention_triton(
        **case, num_kv_splits=num_kv_splits, out=out, lse=lse, _plan_override=plan
    )
    ref_out, ref_lse = paged_attention_ref(**case)
    check_close(f"{name} out", out, ref_out, *ATTN_TOL[q.dtype])
    check_close(f"{name} lse", lse, ref_lse, *LSE_TOL[q.dtype])


@pytest.mark.parametrize(("window", "num_kv_splits"), [(None, 1), (3, 1), (None, 3), (5, 2)])
@pytest.mark.parametrize("group", [1, 3])
def test_paged_attention_over_fp8_pages(group, window, num_kv_splits):
    case = fp8_paged_case(
        mixed_rows(4),
        num_kv_heads=2,
        group=group,
        head_dim=16,
        page=4,
        dtype=torch.float32,
        k_scale=0.4,
        v_scale=3.0,
        window=window,
        seed=10 * group + (window or 0),
    )
    check_fp8_attention(f"fp8 attn g{group} w{window} s{num_kv_splits}", case, num_kv_splits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_attention_over_fp8_pages_half_queries(dtype):
    case = fp8_paged_case(
        mixed_rows(4) + [(9, 20)],
        num_kv_heads=2,
        group=2,
        head_dim=24,
        page=4,
        dtype=dtype,
        k_scale=1.0,
        v_scale=0.5,
        seed=3,
    )
    check_fp8_attention(f"fp8 attn {dtype}", case)
    check_fp8_attention(f"fp8 attn {dtype} small tiles", case, plan=small_plan(2, 24))


def test_paged_attention_fp8_rejects_bad_scales_and_dtypes():
    case = fp8_paged_case(
        [(1, 3)],
        num_kv_heads=1,
        group=1,
        head_dim=16,
        page=4,
        dtype=torch.float32,
        k_scale=1.0,
        v_scale=1.0,
    )
    with pytest.raises(ValueError, match="v_scale"):
        paged_attention_triton(**{**case, "v_scale": 0.0})
    with pytest.raises(ValueError, match="kv_cache: dtype"):
        paged_attention_triton(**{**case, "kv_cache": case["kv_cache"].view(torch.int8)})


# ------------------------------------------------------------------------------------ MLA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_over_fp8_latent_pages(dtype):
    """The latent cache as keys = values (kernels/ops.py on CUDA): written through the
    KV-write kernel with one scale (bitwise the MLA reference's), attended by the paged
    kernel (the MLA reference's output within tolerance)."""
    rank, rope, heads, page, num_blocks, s = 24, 8, 4, 4, 16, 0.6
    context, queries = [7, 13, 1, 18], [7, 4, 1, 1]
    g = gen(11)
    order = torch.randperm(num_blocks - 1, generator=g) + 1
    tables = torch.zeros(len(context), 6, dtype=torch.int32)
    slots, used = [], 0
    for row, n in enumerate(context):
        pages = order[used : used + -(-n // page)]
        used += len(pages)
        tables[row, : len(pages)] = pages.to(torch.int32)
        slots += [int(pages[i // page]) * page + i % page for i in range(n)]
    slot_mapping = torch.tensor(slots + [-1], device=DEVICE)  # one padding token
    latent = (torch.randn(len(slots) + 1, rank, generator=g) * 3).to(dtype=dtype, device=DEVICE)
    k_pe = torch.randn(len(slots) + 1, rope, generator=g).to(dtype=dtype, device=DEVICE)
    want = torch.full((num_blocks, page, rank + rope), NAN_BYTE, dtype=torch.uint8, device=DEVICE)
    want = want.view(FP8_DTYPE)
    got = want.clone()
    write_mla_cache_ref(latent, k_pe, want, slot_mapping, s)
    row = torch.cat([latent, k_pe], dim=-1).unsqueeze(1)
    write_kv_cache_triton(row, row, latent_cache_as_kv(got), slot_mapping, s, s)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))

    q_latent = torch.randn(sum(queries), heads, rank, generator=g).to(dtype=dtype, device=DEVICE)
    q_pe = torch.randn(sum(queries), heads, rope, generator=g).to(dtype=dtype, device=DEVICE)
    starts = torch.tensor([0] + queries).cumsum(0).to(torch.int32).to(DEVICE)
    lens = torch.tensor(context, dtype=torch.int32, device=DEVICE)
    tables = tables.to(DEVICE)
    ref, ref_lse = mla_attention_ref(q_latent, q_pe, want, tables, starts, lens, 0.17, s)
    out, lse = paged_attention_triton(
        torch.cat([q_latent, q_pe], dim=-1),
        latent_cache_as_kv(got),
        tables,
        starts,
        lens,
        0.17,
        k_scale=s,
        v_scale=s,
        _plan_override={**small_plan(heads, rank + rope), "num_warps": 4, "num_stages": 2},
    )
    check_close("fp8 mla out", out[..., :rank], ref, *ATTN_TOL[dtype])
    check_close("fp8 mla lse", lse, ref_lse, *LSE_TOL[dtype])


# ------------------------------------------------------------------------------------ GPU


@gpu
@needs_cuda
def test_ops_take_the_triton_paths_for_fp8_pages(monkeypatch):
    """On CUDA, kernels/ops.py sends an FP8 cache to the Triton kernels (not the reference)."""
    from kvloom.kernels import ops
    from kvloom.kernels import paged_attention_triton as pat

    calls = []
    real = pat.paged_attention_triton
    monkeypatch.setattr(
        pat, "paged_attention_triton", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    case = fp8_paged_case(
        [(1, 9)],
        num_kv_heads=2,
        group=2,
        head_dim=64,
        page=16,
        dtype=torch.bfloat16,
        k_scale=0.5,
        v_scale=2.0,
    )
    out, _ = ops.paged_attention(
        case["q"],
        case["kv_cache"],
        case["block_tables"],
        case["query_start_loc"],
        case["seq_lens"],
        case["scale"],
        k_scale=0.5,
        v_scale=2.0,
    )
    assert calls and not out.isnan().any()


def big_rows(seed, decodes, prefills, max_ctx):
    g = gen(seed)
    rows = [(1, int(torch.randint(1, max_ctx, (1,), generator=g))) for _ in range(decodes)]
    for _ in range(prefills):
        ctx = int(torch.randint(64, max_ctx, (1,), generator=g))
        rows.append((int(torch.randint(1, min(ctx, 600), (1,), generator=g)), ctx))
    return rows


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim", "window"),
    [(8, 4, 128, None), (8, 4, 128, 1000), (2, 8, 256, None), (1, 16, 576, None)],
)
def test_gpu_paged_attention_fp8_real_shapes(dtype, num_kv_heads, group, head_dim, window):
    """Qwen3-8B (8 KV heads of 128), a windowed layer, Qwen3-Next's 2 heads of 256, and an
    MLA-like 576-wide single KV head; decodes and prefill chunks, with split-KV."""
    rows = big_rows(seed=head_dim + group, decodes=32, prefills=4, max_ctx=4000)
    case = fp8_paged_case(
        rows,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        page=16,
        dtype=dtype,
        k_scale=0.7,
        v_scale=1.3,
        window=window,
        seed=group,
    )
    name = f"gpu fp8 attn {dtype} kv{num_kv_heads} g{group} d{head_dim} w{window}"
    check_fp8_attention(name, case)
    check_fp8_attention(name + " split4", case, 4)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_write_kv_cache_fp8_rounds_like_torch(dtype):
    """The GPU's float32 -> e4m3 conversion (cvt.rn.satfinite) is torch's, bitwise, over
    every e4m3 value, the midpoints between neighbours, and random values."""
    finite = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    finite = finite[finite.isfinite()].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    rand = torch.randn(4096, generator=gen(1)) * torch.logspace(-10, 9, 4096, base=2)
    values = torch.cat([finite, mids, rand, torch.tensor([float("nan"), 1e6, -1e6])])
    n = values.numel()
    key = values.view(n, 1, 1).to(dtype=dtype, device=DEVICE)
    cache = torch.zeros(2, n, 1, 1, 1, dtype=FP8_DTYPE, device=DEVICE)
    expected = cache.clone()
    slots = torch.arange(n, device=DEVICE)
    write_kv_cache_ref(key, key, expected, slots, 1.0, 0.25)
    write_kv_cache_triton(key, key, cache, slots, 1.0, 0.25)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
