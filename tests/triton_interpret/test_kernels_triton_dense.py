"""Every dense Triton kernel against its pure-torch reference, on fresh random inputs.

Without CUDA the kernels run in Triton's CPU interpreter (the conftest beside this file
sets TRITON_INTERPRET=1) at tiny shapes; with CUDA the same tests run compiled, and the
`gpu`-marked tests add real model shapes in bfloat16, float16 and float32. Each check
prints `ERRNORM <name>: max_abs=... rel_l2=...` (shown with `pytest -s`).

Caches are poisoned the way the sanitizer poisons them: unused pages, slots past a row's
context and pages a sliding window no longer reaches hold NaN, so a kernel that reads
them fails. Outputs are pre-filled with NaN, so an element the kernel forgets to write
fails too.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from kvloom.kernels.activation import gated_add_ref, silu_and_mul_ref
from kvloom.kernels.activation_triton import gated_add_triton, silu_and_mul_triton
from kvloom.kernels.dispatch import use_triton
from kvloom.kernels.kv_cache_write import write_kv_cache_ref
from kvloom.kernels.kv_cache_write_triton import write_kv_cache_triton
from kvloom.kernels.merge_attention_states import merge_attention_states_ref
from kvloom.kernels.merge_attention_states_triton import merge_attention_states_triton
from kvloom.kernels.paged_attention import paged_attention_ref
from kvloom.kernels.paged_attention_triton import (
    choose_num_kv_splits,
    paged_attention_split_kv_triton,
    paged_attention_triton,
)
from kvloom.kernels.rms_norm import rms_norm_ref
from kvloom.kernels.rms_norm_triton import rms_norm_triton
from kvloom.kernels.rotary import apply_rotary_ref
from kvloom.kernels.rotary_triton import apply_rotary_triton
from kvloom.kernels.sampling import top_k_top_p_probs_ref
from kvloom.kernels.sampling_triton import top_k_top_p_probs_triton

# The conftest sets this when this process cannot interpret kernels; then
# test_kernels_triton_fresh_process.py runs this module in a fresh process instead.
pytestmark = pytest.mark.skipif(
    os.environ.get("KVLOOM_TRITON_CHECKS_IN_SUBPROCESS") == "1",
    reason="triton was imported for the compiler first: checked in a fresh process",
)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

HALF = (torch.bfloat16, torch.float16)
# (atol, rtol) of attention outputs: half inputs feed probabilities rounded to the input
# dtype to the P @ V product; float32 runs exact-precision dots.
ATTN_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}
LSE_TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (1e-4, 1e-5), torch.bfloat16: (1e-4, 1e-5)}
# One rounding of a result to the dtype, plus a last-bit float32 difference before it.
ELEMENTWISE_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def rng(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    """Fresh normal values made on the CPU (same on every device), moved to DEVICE."""
    return (torch.randn(*shape, generator=rng(seed)) * scale).to(dtype=dtype, device=DEVICE)


def check_close(name, actual, expected, atol, rtol):
    """assert_close plus the error norms it saw; infinities must match exactly."""
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    assert not torch.isnan(a).any(), f"{name}: NaN in the kernel's output"
    finite = torch.isfinite(e)
    diff = (a - e)[finite]
    max_abs = diff.abs().max().item() if diff.numel() else 0.0
    denom = e[finite].norm().item()
    rel = diff.norm().item() / denom if denom else diff.norm().item()
    print(f"ERRNORM {name}: max_abs={max_abs:.3e} rel_l2={rel:.3e}")
    torch.testing.assert_close(a, e, atol=atol, rtol=rtol, equal_nan=False)


# ----------------------------------------------------------------------------- attention


def make_paged_case(
    rows,
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    page: int,
    dtype: torch.dtype,
    window: int | None = None,
    tail: int = 0,
    seed: int = 0,
):
    """rows: list of (query_len, context_len). Returns the kernel's arguments.

    Pages are shuffled; every table entry a row does not need, and every page wholly
    before the window of the row's first query, points at an all-NaN page; slots past a
    row's context in its last page are NaN too.
    """
    g = rng(seed)
    need = [max(1, math.ceil(ctx / page)) for _, ctx in rows]
    max_pages = max(need) + 1
    num_pages = sum(need) + 2
    kv = torch.randn(2, num_pages, page, num_kv_heads, head_dim, generator=g)
    poison = num_pages - 1
    kv[:, poison] = float("nan")
    order = torch.randperm(num_pages - 1, generator=g).tolist()
    tables = torch.full((len(rows), max_pages), poison, dtype=torch.int32)
    for i, (q_len, ctx) in enumerate(rows):
        used = math.ceil(ctx / page)
        first_visible = 0 if window is None else max(0, ctx - q_len - window + 1)
        for b in range(used):
            pid = order.pop()
            tables[i, b] = pid
            if (b + 1) * page <= first_visible:
                tables[i, b] = poison  # freed by the window
            if b == used - 1 and ctx % page:
                kv[:, pid, ctx % page :] = float("nan")
    total = sum(q for q, _ in rows)
    q = torch.randn(total + tail, num_kv_heads * group, head_dim, generator=g)
    qsl = torch.tensor([0] + [sum(r[0] for r in rows[: i + 1]) for i in range(len(rows))])
    return dict(
        q=q.to(dtype=dtype, device=DEVICE),
        kv_cache=kv.to(dtype=dtype, device=DEVICE),
        block_tables=tables.to(DEVICE),
        query_start_loc=qsl.to(dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([c for _, c in rows], dtype=torch.int32, device=DEVICE),
        scale=head_dim**-0.5,
        sliding_window=window,
    )


def mixed_rows(page: int):
    """Decodes at block-boundary contexts, a full prefill, a chunk resuming a prefill, a
    one-token first chunk, zero-length rows, and a row without context."""
    return [
        (1, 1),
        (1, page - 1) if page > 1 else (1, 2),
        (1, page),
        (1, page + 1),
        (page + 2, page + 2),
        (3, 2 * page + 1),
        (0, 5),
        (0, 0),
        (1, 3 * page),
        (2, 0),
    ]


SMALL_PLAN = {"BLOCK_M": 16, "TILE": 16, "num_warps": 4, "num_stages": 2}


def small_plan(group: int, head_dim: int) -> dict:
    """A plan with small tiles so tiny tests cross query-block and key-tile boundaries."""
    block_m = max(16, 1 << (group - 1).bit_length())
    return {
        **SMALL_PLAN,
        "BLOCK_M": block_m,
        "BLOCK_Q": block_m // group,
        "DIM_PAD": max(16, 1 << (head_dim - 1).bit_length()),
    }


def run_attention(case, num_kv_splits=1, plan=None):
    q = case["q"]
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)
    got = paged_attention_triton(
        **case, num_kv_splits=num_kv_splits, out=out, lse=lse, _plan_override=plan
    )
    assert got[0] is out and got[1] is lse
    return out, lse


def check_attention(name, case, num_kv_splits=1, plan=None):
    out, lse = run_attention(case, num_kv_splits, plan)
    ref_out, ref_lse = paged_attention_ref(**case)
    dtype = case["q"].dtype
    check_close(f"{name} out", out, ref_out, *ATTN_TOL[dtype])
    check_close(f"{name} lse", lse, ref_lse, *LSE_TOL[dtype])
    return out, lse


@pytest.mark.parametrize(
    ("window", "num_kv_splits"), [(None, 1), (1, 1), (4, 1), (5, 1), (None, 3), (5, 3)]
)
@pytest.mark.parametrize("group", [1, 2, 4])
def test_paged_attention_mixed_batch(group, window, num_kv_splits):
    case = make_paged_case(
        mixed_rows(4),
        num_kv_heads=2,
        group=group,
        head_dim=16,
        page=4,
        dtype=torch.float32,
        window=window,
        tail=2,
        seed=100 * group + (window or 0),
    )
    check_attention(f"attn g{group} w{window} s{num_kv_splits}", case, num_kv_splits)


@pytest.mark.parametrize(
    ("group", "window", "num_kv_splits", "head_dim", "page"),
    [
        (1, None, 1, 16, 4),
        (3, None, 1, 24, 4),  # non-power-of-two group and head dim
        (4, 5, 2, 16, 4),
        (2, 7, 1, 16, 1),  # one-token pages
        (2, None, 4, 32, 8),
    ],
)
def test_paged_attention_long_rows(group, window, num_kv_splits, head_dim, page):
    """Long rows cut into several query blocks and key tiles."""
    rows = [(1, 37), (21, 21), (9, 30), (1, 2), (0, 3), (17, 40)]
    case = make_paged_case(
        rows,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        page=page,
        dtype=torch.float32,
        window=window,
        tail=1,
        seed=7 + group,
    )
    name = f"attn long-rows g{group} w{window} s{num_kv_splits} d{head_dim} p{page}"
    check_attention(name, case, num_kv_splits)
    check_attention(name + " small tiles", case, num_kv_splits, small_plan(group, head_dim))


def test_paged_attention_decode_hint_changes_nothing():
    """max_query_len=1 skips the long-row launch of a decode batch, bitwise the same."""
    case = make_paged_case(
        [(1, 9), (1, 1), (1, 4), (1, 13)],
        num_kv_heads=2,
        group=2,
        head_dim=16,
        page=4,
        dtype=torch.float32,
        seed=12,
    )
    out, lse = run_attention(case)
    hinted, hinted_lse = paged_attention_triton(**case, max_query_len=1)
    assert torch.equal(out, hinted) and torch.equal(lse, hinted_lse)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("window", [None, 3])
def test_paged_attention_half(dtype, window):
    case = make_paged_case(
        mixed_rows(4),
        num_kv_heads=2,
        group=2,
        head_dim=16,
        page=4,
        dtype=dtype,
        window=window,
        tail=1,
        seed=31,
    )
    check_attention(f"attn {dtype} w{window}", case, 1)
    check_attention(f"attn {dtype} w{window} split", case, 2)


def test_paged_attention_batch_invariant():
    """A row's result is bitwise the same alone as in a mixed batch."""
    rows = mixed_rows(4)
    case = make_paged_case(
        rows, num_kv_heads=2, group=2, head_dim=16, page=4, dtype=torch.float32, seed=5
    )
    out, lse = run_attention(case)
    starts = case["query_start_loc"].tolist()
    for i in (0, 3, 4, 5, 8):
        alone = dict(case)
        alone["q"] = case["q"][starts[i] : starts[i + 1]]
        alone["block_tables"] = case["block_tables"][i : i + 1]
        alone["seq_lens"] = case["seq_lens"][i : i + 1]
        alone["query_start_loc"] = torch.tensor(
            [0, starts[i + 1] - starts[i]], dtype=torch.int32, device=DEVICE
        )
        out_i, lse_i = run_attention(alone)
        assert torch.equal(out_i, out[starts[i] : starts[i + 1]]), f"row {i} output differs"
        assert torch.equal(lse_i, lse[starts[i] : starts[i + 1]]), f"row {i} lse differs"


def test_paged_attention_no_rows_and_no_tokens():
    case = make_paged_case(
        [(0, 4), (0, 0)],
        num_kv_heads=1,
        group=2,
        head_dim=16,
        page=4,
        dtype=torch.float32,
        tail=3,
    )
    out, lse = run_attention(case)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
    empty = dict(case, q=case["q"][:0])
    out, lse = paged_attention_triton(**empty)
    assert out.shape == (0, 2, 16) and lse.shape == (0, 2)


def test_paged_attention_rejects_bad_arguments():
    case = make_paged_case(
        [(1, 3)], num_kv_heads=2, group=2, head_dim=16, page=4, dtype=torch.float32
    )
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention_triton(**dict(case, sliding_window=0))
    with pytest.raises(ValueError, match="num_kv_splits"):
        paged_attention_triton(**case, num_kv_splits=0)
    with pytest.raises(ValueError, match="max_query_len"):
        paged_attention_triton(**case, max_query_len=-1)
    with pytest.raises(ValueError, match="query heads"):
        paged_attention_triton(**dict(case, q=case["q"][:, :3]))
    with pytest.raises(ValueError, match="kv_cache"):  # a float32 cache under a half q
        paged_attention_triton(**dict(case, q=case["q"].half()))
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention_triton(**dict(case, query_start_loc=case["query_start_loc"][:1]))
    with pytest.raises(ValueError, match="seq_lens"):
        paged_attention_triton(**dict(case, seq_lens=case["seq_lens"].float()))
    with pytest.raises(ValueError, match="q"):
        paged_attention_triton(**dict(case, q=case["q"].double()))


def test_choose_num_kv_splits():
    assert choose_num_kv_splits(2, 8, 32768, 132) == 33  # 4 * 132 programs wanted
    assert choose_num_kv_splits(64, 8, 32768, 132) == 1  # the batch fills the GPU
    assert choose_num_kv_splits(1, 8, 100, 132) == 1  # too short to split
    assert choose_num_kv_splits(1, 1, 10**7, 132) == 64  # capped


def test_paged_attention_split_kv_entry_point():
    case = make_paged_case(
        [(1, 45), (1, 9), (1, 1)],
        num_kv_heads=2,
        group=4,
        head_dim=16,
        page=4,
        dtype=torch.float32,
        seed=9,
    )
    out, lse = paged_attention_split_kv_triton(**case, max_seq_len=45, max_query_len=1)
    ref_out, ref_lse = paged_attention_ref(**case)
    check_close("attn split entry out", out, ref_out, *ATTN_TOL[torch.float32])
    check_close("attn split entry lse", lse, ref_lse, *LSE_TOL[torch.float32])


# ------------------------------------------------------------------------------- KV write


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page", [1, 4, 5])
def test_write_kv_cache(dtype, page):
    tokens, heads, dim, pages = 7, 2, 12, 9
    # key/value as the non-contiguous slices of a fused qkv projection
    qkv = randn(tokens, 3 * heads, dim, seed=page, dtype=dtype)
    key, value = qkv[:, heads : 2 * heads], qkv[:, 2 * heads :]
    slots = torch.randperm(pages * page, generator=rng(page))[:tokens]
    slots[[1, 4]] = -1  # padding tokens
    slots = slots.to(DEVICE)
    cache = randn(2, pages, page, heads, dim, seed=50 + page, dtype=dtype)
    expected = cache.clone()
    write_kv_cache_ref(key, value, expected, slots)
    write_kv_cache_triton(key, value, cache, slots.to(torch.int32))
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_attention_through_the_paged_kernel(dtype):
    """MLA's absorbed attention on the generic paged kernel (ops.mla_attention's CUDA path
    before kernels/mla_attention_triton.py; the cache write still uses this view): the
    latent cache seen as keys = values (stride 0), written through the KV-write kernel,
    equals the MLA reference on mixed rows; unused slots hold NaN and padding is skipped."""
    from kvloom.kernels.mla_attention import mla_attention_ref, write_mla_cache_ref
    from kvloom.kernels.ops import latent_cache_as_kv

    rank, rope, heads, page, num_blocks = 24, 8, 4, 4, 16
    context, queries = [7, 13, 9, 1, 18], [7, 4, 1, 1, 1]
    gen = rng(11)
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.zeros(len(context), 6, dtype=torch.int32)
    slots, used = [], 0
    for row, n in enumerate(context):
        pages = order[used : used + -(-n // page)]
        used += len(pages)
        tables[row, : len(pages)] = pages.to(torch.int32)
        slots += [int(pages[i // page]) * page + i % page for i in range(n)]
    slot_mapping = torch.tensor(slots + [-1, -1], device=DEVICE)  # two padding tokens
    latent = randn(len(slots) + 2, rank, seed=1, dtype=dtype)
    k_pe = randn(len(slots) + 2, rope, seed=2, dtype=dtype)
    want = torch.full((num_blocks, page, rank + rope), float("nan"), dtype=dtype, device=DEVICE)
    got = want.clone()
    write_mla_cache_ref(latent, k_pe, want, slot_mapping)
    row = torch.cat([latent, k_pe], dim=-1).unsqueeze(1)
    write_kv_cache_triton(row, row, latent_cache_as_kv(got), slot_mapping)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())

    q_latent = randn(sum(queries), heads, rank, seed=3, dtype=dtype)
    q_pe = randn(sum(queries), heads, rope, seed=4, dtype=dtype)
    starts = torch.tensor([0] + queries).cumsum(0).to(torch.int32).to(DEVICE)
    lens = torch.tensor(context, dtype=torch.int32, device=DEVICE)
    tables = tables.to(DEVICE)
    scale = 0.17
    ref, ref_lse = mla_attention_ref(q_latent, q_pe, want, tables, starts, lens, scale)
    out, lse = paged_attention_triton(
        torch.cat([q_latent, q_pe], dim=-1),
        latent_cache_as_kv(got),
        tables,
        starts,
        lens,
        scale,
        _plan_override=small_plan(heads, rank + rope),
    )
    check_close("mla out", out[..., :rank], ref, *ATTN_TOL[dtype])
    check_close("mla lse", lse, ref_lse, *LSE_TOL[dtype])


def test_write_kv_cache_casts_and_rejects():
    key = randn(3, 1, 8, seed=1)
    value = randn(3, 1, 8, seed=2)
    cache = randn(2, 2, 4, 1, 8, seed=3, dtype=torch.bfloat16)
    expected = cache.clone()
    slots = torch.tensor([5, -1, 0], device=DEVICE)
    write_kv_cache_ref(key, value, expected, slots)
    write_kv_cache_triton(key, value, cache, slots)
    assert torch.equal(cache, expected)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache_triton(key, value, cache, slots[:2])
    with pytest.raises(ValueError, match="kv_cache"):
        write_kv_cache_triton(key, value, cache[:, :, :, :, :4], slots)


# -------------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
@pytest.mark.parametrize("shape", [(1, 16), (3, 2, 20), (5, 33)])
def test_rms_norm(dtype, with_residual, weight_offset, shape):
    seed = shape[-1] + 3 * with_residual
    x = randn(*shape, seed=seed, dtype=dtype, scale=2.0)
    weight = randn(shape[-1], seed=seed + 1, dtype=dtype, scale=0.5) + 1.0
    residual = randn(*shape, seed=seed + 2, dtype=dtype) if with_residual else None
    eps = 1e-6
    out, res = rms_norm_triton(x, weight, eps, residual, weight_offset)
    ref_out, ref_res = rms_norm_ref(x, weight, eps, residual, weight_offset)
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    check_close(
        f"rmsnorm {dtype} {shape} res{with_residual} off{weight_offset}",
        out,
        ref_out,
        *ELEMENTWISE_TOL[dtype],
    )
    if with_residual:
        assert torch.equal(res, ref_res)
    else:
        assert res is None


def test_rms_norm_in_place_and_mixed_dtypes():
    x = randn(4, 24, seed=1, dtype=torch.bfloat16)
    residual = randn(4, 24, seed=2, dtype=torch.bfloat16)
    weight = randn(24, seed=3, dtype=torch.float32)
    ref_out, ref_res = rms_norm_ref(x, weight, 1e-5, residual)  # float32 weight: float32 out
    assert ref_out.dtype == torch.float32
    out, res = rms_norm_triton(x, weight, 1e-5, residual)
    check_close("rmsnorm fp32 weight on bf16", out, ref_out, *ELEMENTWISE_TOL[torch.float32])
    assert torch.equal(res, ref_res)
    # in place, as model code does: the normalised x overwrites x, the sum the residual
    w16 = weight.to(torch.bfloat16)
    ref_out, ref_res = rms_norm_ref(x, w16, 1e-5, residual)
    out, res = rms_norm_triton(x, w16, 1e-5, residual, out=x, residual_out=residual)
    assert out is x and res is residual
    check_close("rmsnorm in place", x, ref_out, *ELEMENTWISE_TOL[torch.bfloat16])
    assert torch.equal(residual, ref_res)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, weight[:3], 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_triton(x, w16, 1e-5, residual[:2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_stores_its_rows_widened_too(dtype, with_residual):
    """out_float32 (Kimi-Linear's float32 router reads it): exactly out.float(), in the
    same launch, and out / residual as without it."""
    x = randn(3, 40, seed=11, dtype=dtype, scale=2.0)
    weight = randn(40, seed=12, dtype=dtype, scale=0.5) + 1.0
    residual = randn(3, 40, seed=13, dtype=dtype) if with_residual else None
    plain, plain_res = rms_norm_triton(x, weight, 1e-6, residual)
    widened = torch.full((3, 40), float("nan"))
    out, res = rms_norm_triton(x, weight, 1e-6, residual, out_float32=widened)
    assert torch.equal(out, plain) and torch.equal(widened, out.float())
    assert res is None if residual is None else torch.equal(res, plain_res)
    with pytest.raises(ValueError, match="out_float32"):
        rms_norm_triton(x, weight, 1e-6, residual, out_float32=widened.to(dtype))


# --------------------------------------------------------------------------------- rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(16, None), (24, 8), (32, 16)])
def test_rotary(dtype, head_dim, rotary_dim):
    tokens, heads = 5, 3
    rot = rotary_dim or head_dim
    # q as a non-contiguous slice of a fused projection
    fused = randn(tokens, 2 * heads, head_dim, seed=head_dim, dtype=dtype)
    x = fused[:, :heads]
    positions = torch.tensor([0, 1, 7, 100, 4095], dtype=torch.float32)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    angles = positions[:, None] * inv_freq[None]
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    expected = apply_rotary_ref(x, cos, sin, rotary_dim)
    out = apply_rotary_triton(x, cos, sin, rotary_dim)
    if dtype in HALF:
        assert torch.equal(out, expected), "half-precision rotary should match bitwise"
    check_close(f"rotary {dtype} d{head_dim} r{rot}", out, expected, 2e-6, 2e-6)
    # in place
    y = x.clone()
    apply_rotary_triton(y, cos, sin, rotary_dim, out=y)
    assert torch.equal(y, out)


def test_rotary_rejects_bad_shapes():
    x = randn(2, 1, 8, seed=0)
    cos = randn(2, 4, seed=1)
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary_triton(x, cos, cos, 3)
    with pytest.raises(ValueError, match="sin"):
        apply_rotary_triton(x, cos, cos[:1])


# ------------------------------------------------------------------------- SiLU-and-mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 2), (3, 40), (2, 3, 2 * 37)])
def test_silu_and_mul(dtype, shape):
    x = randn(*shape, seed=shape[-1], dtype=dtype, scale=3.0)
    out = silu_and_mul_triton(x)
    check_close(f"silu_and_mul {dtype} {shape}", out, silu_and_mul_ref(x), *ELEMENTWISE_TOL[dtype])


def test_silu_and_mul_rejects_odd_width():
    with pytest.raises(ValueError, match="x"):
        silu_and_mul_triton(randn(2, 5, seed=0))


# ------------------------------------------------------------- gated add (shared expert)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 3), (5, 40), (2, 1500)])
def test_gated_add(dtype, shape):
    rows, n = shape
    base = randn(rows, n, seed=n, dtype=dtype, scale=2.0)
    gate = randn(rows, 1, seed=n + 1, dtype=dtype, scale=3.0)
    x = randn(rows, n, seed=n + 2, dtype=dtype, scale=2.0)
    out = gated_add_triton(base, gate, x)
    check_close(
        f"gated_add {dtype} {shape}", out, gated_add_ref(base, gate, x), *ELEMENTWISE_TOL[dtype]
    )
    # Each row takes its own gate: a row's result does not depend on the others.
    alone = gated_add_triton(base[-1:], gate[-1:], x[-1:])
    assert torch.equal(alone, out[-1:])


def test_gated_add_rejects_mismatched_shapes():
    base = randn(2, 8, seed=0)
    with pytest.raises(ValueError, match="gate_logit"):
        gated_add_triton(base, randn(2, 2, seed=1), randn(2, 8, seed=2))
    with pytest.raises(ValueError, match="x"):
        gated_add_triton(base, randn(2, 1, seed=1), randn(2, 8, seed=2, dtype=torch.float16))


# ------------------------------------------------------------------------- LSE merge


def make_parts(parts, tokens, heads, dim, seed, dtype=torch.float32):
    outputs = randn(parts, tokens, heads, dim, seed=seed, dtype=dtype)
    lses = randn(parts, tokens, heads, seed=seed + 1, scale=3.0)
    lses[0, 0, :] = float("-inf")  # a part without keys for token 0
    lses[:, 1, 0] = float("-inf")  # token 1, head 0: no keys anywhere
    outputs[0, 0] = float("nan")  # garbage where a part has no keys is never read
    outputs[:, 1, 0] = float("nan")
    return outputs, lses


@pytest.mark.parametrize("parts", [1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_attention_states(parts, dtype):
    outputs, lses = make_parts(parts, 4, 3, 20, seed=parts, dtype=dtype)
    clean = outputs.masked_fill(torch.isneginf(lses)[..., None], 0.0)  # the ref multiplies
    ref_out, ref_lse = merge_attention_states_ref(clean, lses)
    out, lse = merge_attention_states_triton(outputs, lses)
    tol = ELEMENTWISE_TOL[dtype]
    check_close(f"merge {dtype} P{parts} out", out, ref_out, *tol)
    check_close(f"merge {dtype} P{parts} lse", lse, ref_lse, 1e-5, 1e-6)
    assert torch.isneginf(lse[1, 0]) and torch.equal(out[1, 0], torch.zeros_like(out[1, 0]))


def test_merge_attention_states_aliasing_and_out_dtype():
    outputs, lses = make_parts(3, 5, 2, 16, seed=11)
    clean = outputs.masked_fill(torch.isneginf(lses)[..., None], 0.0)
    ref_out, ref_lse = merge_attention_states_ref(clean, lses)
    # merged into part 0 in place
    parts, part_lses = outputs.clone(), lses.clone()
    out, lse = merge_attention_states_triton(parts, part_lses, out=parts[0], out_lse=part_lses[0])
    check_close("merge aliased out", parts[0], ref_out, 1e-6, 1e-6)
    check_close("merge aliased lse", part_lses[0], ref_lse, 1e-6, 1e-6)
    # float32 parts straight into a bfloat16 output
    out16 = torch.full(ref_out.shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)
    merge_attention_states_triton(outputs, lses, out=out16)
    check_close("merge into bf16", out16, ref_out, *ELEMENTWISE_TOL[torch.bfloat16])


# ------------------------------------------------------------------------------ sampling


def brute_force_probs(row: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """The docstring's definition, one row, in float64 with plain Python loops."""
    x = [float("-inf") if math.isnan(v) else min(v, 3.4028234663852886e38) for v in row.tolist()]
    if all(v == float("-inf") for v in x):
        x = [0.0] * len(x)
    if 0 < k < len(x):
        kth = sorted(x, reverse=True)[k - 1]
        x = [v if v >= kth else float("-inf") for v in x]
    top = max(x)
    e = [math.exp(v - top) for v in x]
    probs = [v / sum(e) for v in e]
    if p < 1.0:
        ordered = sorted(probs, reverse=True)
        total, threshold = 0.0, ordered[-1]
        for v in ordered:
            total += v
            if total >= p:
                threshold = v
                break
        probs = [v if v >= threshold else 0.0 for v in probs]
        s = sum(probs)
        probs = [v / s for v in probs]
    return torch.tensor(probs, dtype=torch.float64)


def sampling_case(vocab: int, seed: int, dtype=torch.float32):
    rows = 8
    logits = torch.randn(rows, vocab, generator=rng(seed)) * 2.0
    logits[1, 3] = float("nan")
    logits[2] = float("-inf")  # a padding row: uniform, never NaN
    logits[3, ::2] = float("nan")
    logits[4, 5] = logits[4, 9] = float("inf")  # two +inf share the mass
    logits[5, :6] = 4.0  # ties at the top-k boundary are all kept
    logits[6] = float("nan")
    top_k = torch.tensor([5, -1, 3, 1, 0, 2, vocab, vocab + 3])
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.0, 0.3, 0.7, float("nan"), 0.25])
    return logits.to(dtype=dtype, device=DEVICE), top_k.to(DEVICE), top_p.to(DEVICE)


@pytest.mark.parametrize("which", ["none", "top_k", "top_p", "both", "scalars"])
def test_sampling_ref_matches_definition(which):
    logits, top_k, top_p = sampling_case(40, seed=3)
    ks, ps = {
        "none": (None, None),
        "top_k": (top_k, None),
        "top_p": (None, top_p),
        "both": (top_k, top_p),
        "scalars": (4, 0.6),
    }[which]
    probs = top_k_top_p_probs_ref(logits, ks, ps)
    for r in range(logits.shape[0]):
        k = -1 if ks is None else int(ks if isinstance(ks, int) else ks[r])
        p = 1.0 if ps is None else float(ps if isinstance(ps, float) else ps[r])
        p = 1.0 if math.isnan(p) else p
        expected = brute_force_probs(logits[r].float().cpu(), k, p)
        torch.testing.assert_close(probs[r].double().cpu(), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("which", "vocab"),
    [(w, 40) for w in ("none", "top_k", "top_p", "both", "scalars")]
    + [("both", 1100)],  # several segments per row
)
def test_top_k_top_p_probs(which, vocab):
    logits, top_k, top_p = sampling_case(vocab, seed=vocab)
    ks, ps = {
        "none": (None, None),
        "top_k": (top_k, None),
        "top_p": (None, top_p),
        "both": (top_k, top_p),
        "scalars": (4, 0.6),
    }[which]
    tuning = {"_block": 256, "_segment": 512} if vocab > 1000 else {}
    check_sampling(f"sampling {which} V{vocab}", logits, ks, ps, **tuning)


@pytest.mark.parametrize("bits", [4, 8])
def test_top_k_top_p_probs_radix_widths(bits):
    """Every digit width finds the same cut-offs, ties included (rounded logits)."""
    logits = (torch.randn(5, 90, generator=rng(bits)) * 3).round().to(DEVICE)
    top_k = torch.tensor([1, 7, 20, 3, -1], device=DEVICE)
    top_p = torch.tensor([0.5, 0.9, 0.2, 1.0, 0.75], device=DEVICE)
    # 32-token blocks in 64-token segments: two programs per row
    check_sampling(
        f"sampling radix {bits} bits", logits, top_k, top_p, _bits=bits, _block=32, _segment=64
    )


@pytest.mark.parametrize("dtype", HALF)
def test_top_k_top_p_probs_half_logits(dtype):
    logits, top_k, top_p = sampling_case(60, seed=2, dtype=dtype)
    check_sampling(f"sampling {dtype}", logits, top_k, top_p)


@pytest.mark.parametrize("vocab", [1, 2])
def test_top_k_top_p_probs_tiny_vocab(vocab):
    logits = randn(3, vocab, seed=vocab)
    logits[1] = float("nan")
    for ks, ps in ((None, None), (1, 0.5), (torch.tensor([1, 2, -1], device=DEVICE), None)):
        check_sampling(f"sampling V{vocab}", logits, ks, ps)


def check_sampling(name, logits, ks, ps, **tuning):
    out = torch.full(logits.shape, float("nan"), dtype=torch.float32, device=logits.device)
    probs = top_k_top_p_probs_triton(logits, ks, ps, out=out, **tuning)
    expected = top_k_top_p_probs_ref(logits, ks, ps)
    assert probs is out
    ambiguous = top_p_boundary_rows(name, logits, ks, ps, probs > 0, expected > 0)
    same = torch.ones(logits.shape[0], dtype=torch.bool)
    same[ambiguous] = False
    check_close(name, probs[same.to(probs.device)], expected[same.to(probs.device)], 1e-6, 1e-5)
    torch.testing.assert_close(
        probs.sum(-1), torch.ones(logits.shape[0], device=logits.device), atol=1e-5, rtol=0
    )


def top_p_boundary_rows(name, logits, ks, ps, got_keep, ref_keep) -> list[int]:
    """Rows whose kept sets differ. Top-k sets must match exactly; a top-p set may differ
    only where the cumulative probability meets p within float32 rounding (the reference
    sums a sorted cumsum, the kernel per-digit masses): the sets must be nested, and the
    smaller one's exact (float64) mass must be within 1e-4 of p."""
    rows = torch.nonzero((got_keep != ref_keep).any(-1)).flatten().tolist()
    if not rows:
        return rows
    assert ps is not None, f"{name}: kept sets differ in rows {rows} without top-p"
    base = top_k_top_p_probs_ref(logits.double(), ks, None)  # float64, before top-p
    for r in rows:
        p = float(ps if isinstance(ps, float) else ps[r])
        a, b = got_keep[r], ref_keep[r]
        small, big = (a, b) if a.sum() <= b.sum() else (b, a)
        assert not (small & ~big).any(), f"{name}: row {r}: kept sets are not nested"
        mass = base[r][small].sum().item()
        assert abs(mass - p) <= 1e-4, f"{name}: row {r}: kept mass {mass} is far from p={p}"
        assert base[r][big & ~small].max() <= base[r][small].min(), f"{name}: row {r}: order"
    return rows


def test_sampling_rejects_bad_arguments():
    logits = randn(2, 10, seed=0)
    with pytest.raises(ValueError, match="top_p"):
        top_k_top_p_probs_triton(logits, None, 1.5)
    with pytest.raises(ValueError, match="top_k"):
        top_k_top_p_probs_triton(logits, torch.tensor([1.0, 2.0], device=DEVICE), None)
    with pytest.raises(ValueError, match="logits"):
        top_k_top_p_probs_ref(logits[0], None, None)


# ------------------------------------------------------------------------------ dispatch


def test_use_triton(monkeypatch):
    monkeypatch.delenv("KVLOOM_DISABLE_TRITON", raising=False)
    assert not use_triton(torch.zeros(2))  # CPU
    with pytest.raises(ValueError, match="tensor"):
        use_triton([1, 2])
    if CUDA:
        assert use_triton(torch.zeros(2, device="cuda"))
        assert not use_triton(torch.zeros(2, device="cuda", dtype=torch.float64))
        monkeypatch.setenv("KVLOOM_DISABLE_TRITON", "1")
        assert not use_triton(torch.zeros(2, device="cuda"))


# ----------------------------------------------------------------- real shapes, on the GPU

ALL_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def big_rows(seed: int, decodes: int, prefills: int, max_ctx: int):
    g = rng(seed)
    rows = []
    for _ in range(decodes):
        rows.append((1, int(torch.randint(1, max_ctx, (1,), generator=g))))
    for _ in range(prefills):
        q_len = int(torch.randint(1, 600, (1,), generator=g))
        prefix = int(torch.randint(0, 1500, (1,), generator=g))
        rows.append((q_len, q_len + prefix))
    rows += [(1, 15), (1, 16), (1, 17), (16, 16), (0, 40)]
    return rows


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim", "window"),
    [
        (8, 4, 128, None),  # Qwen3-8B / Llama-3-8B
        (8, 4, 128, 1000),  # Mistral-style window
        (4, 7, 128, None),  # Qwen2-7B: 28 query heads over 4
        (16, 1, 64, None),  # MHA
        (8, 2, 256, 127),  # wide heads, a window that is no tile multiple
        (2, 8, 128, None),
    ],
)
def test_gpu_paged_attention_real_shapes(dtype, num_kv_heads, group, head_dim, window):
    rows = big_rows(seed=head_dim + group, decodes=48, prefills=6, max_ctx=5000)
    case = make_paged_case(
        rows,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        page=16,
        dtype=dtype,
        window=window,
        tail=3,
        seed=group,
    )
    name = f"gpu attn {dtype} kv{num_kv_heads} g{group} d{head_dim} w{window}"
    check_attention(name, case, 1)
    check_attention(name + " split4", case, 4)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("window", [None, 4096])
def test_gpu_paged_attention_split_kv_long_decode(dtype, window):
    rows = [(1, 32768), (1, 20000), (1, 4097)]
    case = make_paged_case(
        rows, num_kv_heads=8, group=4, head_dim=128, page=16, dtype=dtype, window=window, seed=3
    )
    out, lse = paged_attention_split_kv_triton(**case, max_seq_len=32768, max_query_len=1)
    ref_out, ref_lse = paged_attention_ref(**case)
    name = f"gpu attn split-kv long decode {dtype} w{window}"
    check_close(name + " out", out, ref_out, *ATTN_TOL[dtype])
    check_close(name + " lse", lse, ref_lse, *LSE_TOL[dtype])


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", HALF)
def test_gpu_paged_attention_batch_invariant(dtype):
    rows = big_rows(seed=1, decodes=20, prefills=3, max_ctx=3000)
    case = make_paged_case(
        rows, num_kv_heads=8, group=4, head_dim=128, page=16, dtype=dtype, seed=4
    )
    out, lse = run_attention(case)
    starts = case["query_start_loc"].tolist()
    for i in range(0, len(rows), 4):
        alone = dict(case)
        alone["q"] = case["q"][starts[i] : starts[i + 1]]
        alone["block_tables"] = case["block_tables"][i : i + 1]
        alone["seq_lens"] = case["seq_lens"][i : i + 1]
        alone["query_start_loc"] = torch.tensor(
            [0, starts[i + 1] - starts[i]], dtype=torch.int32, device=DEVICE
        )
        out_i, lse_i = run_attention(alone)
        assert torch.equal(out_i, out[starts[i] : starts[i + 1]]), f"row {i} output differs"
        assert torch.equal(lse_i, lse[starts[i] : starts[i + 1]]), f"row {i} lse differs"


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_gpu_small_kernels_real_shapes(dtype):
    tokens, hidden, heads, kv_heads, dim = 512, 4096, 32, 8, 128
    # KV write into a 2000-page cache
    key = randn(tokens, kv_heads, dim, seed=1, dtype=dtype)
    value = randn(tokens, kv_heads, dim, seed=2, dtype=dtype)
    cache = randn(2, 2000, 16, kv_heads, dim, seed=3, dtype=dtype)
    slots = torch.randperm(2000 * 16, generator=rng(4))[:tokens]
    slots[::37] = -1
    slots = slots.to(DEVICE)
    expected = cache.clone()
    write_kv_cache_ref(key, value, expected, slots)
    write_kv_cache_triton(key, value, cache, slots)
    assert torch.equal(cache, expected)
    # fused residual add + RMSNorm, both weight conventions
    x = randn(tokens, hidden, seed=5, dtype=dtype, scale=3.0)
    residual = randn(tokens, hidden, seed=6, dtype=dtype)
    weight = randn(hidden, seed=7, dtype=dtype, scale=0.1) + 1.0
    for offset in (0.0, 1.0):
        out, res = rms_norm_triton(x, weight, 1e-6, residual, offset)
        ref_out, ref_res = rms_norm_ref(x, weight, 1e-6, residual, offset)
        check_close(f"gpu rmsnorm {dtype} off{offset}", out, ref_out, *ELEMENTWISE_TOL[dtype])
        assert torch.equal(res, ref_res)
    # rotary on q (full) and a partial-rotary variant
    q = randn(tokens, heads, dim, seed=8, dtype=dtype)
    for rot in (dim, dim // 2):
        angles = torch.arange(tokens, dtype=torch.float32)[:, None] * (
            1e6 ** (-torch.arange(0, rot, 2, dtype=torch.float32) / rot)
        )
        cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
        out = apply_rotary_triton(q, cos, sin, rot)
        ref = apply_rotary_ref(q, cos, sin, rot)
        if dtype in HALF:
            assert torch.equal(out, ref)
        check_close(f"gpu rotary {dtype} r{rot}", out, ref, 2e-6, 2e-6)
    # SiLU-and-mul at an MLP width
    gate_up = randn(tokens, 2 * 12288, seed=9, dtype=dtype, scale=2.0)
    check_close(
        f"gpu silu_and_mul {dtype}",
        silu_and_mul_triton(gate_up),
        silu_and_mul_ref(gate_up),
        *ELEMENTWISE_TOL[dtype],
    )
    # LSE merge of 4 DCP ranks, aliasing the local part
    outputs, lses = make_parts(4, tokens, heads, dim, seed=10, dtype=dtype)
    clean = outputs.masked_fill(torch.isneginf(lses)[..., None], 0.0)
    ref_out, ref_lse = merge_attention_states_ref(clean, lses)
    merge_attention_states_triton(outputs, lses, out=outputs[0], out_lse=lses[0])
    check_close(f"gpu merge {dtype}", outputs[0], ref_out, *ELEMENTWISE_TOL[dtype])
    check_close(f"gpu merge lse {dtype}", lses[0], ref_lse, 1e-5, 1e-6)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_gpu_top_k_top_p_real_vocab(dtype):
    rows, vocab = 64, 151936
    g = rng(12)
    logits = (torch.randn(rows, vocab, generator=g) * 3.0).to(dtype=dtype, device=DEVICE)
    logits[0] = float("nan")
    logits[1, :1000] = float("-inf")
    top_k = torch.randint(-1, 200, (rows,), generator=g)
    top_k[::5] = -1
    top_p = torch.rand(rows, generator=g)
    top_p[::7] = 1.0
    top_p[3] = 0.0
    top_k, top_p = top_k.to(DEVICE), top_p.to(DEVICE)
    for ks, ps, name in ((top_k, None, "k"), (None, top_p, "p"), (top_k, top_p, "kp")):
        check_sampling(f"gpu sampling {dtype} {name}", logits, ks, ps)
