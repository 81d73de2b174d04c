"""The fused softmax top-k router (`softmax_topk_triton`) against its torch reference.

Without CUDA the kernel runs in Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1) at small shapes; with CUDA the same tests run compiled, and the
`gpu`-marked ones add Qwen3-Next's router (512 experts, top-10, renormalised) at decode
and prefill sizes plus a CUDA-graph capture. Logits are fresh random values per case,
drawn distinct in their own dtype, so the expert ids must match exactly.

Weight tolerances: float32 within 2e-6 relative (the two sums run in another order, and
the GPU's exp is the ex2 approximation); float16/bfloat16 within one unit in the last
place of the reference (a last-bit float32 difference can flip one rounding).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kvloom.kernels.fused_moe_triton import fused_moe_triton
from kvloom.kernels.moe_router import softmax_topk_ref
from kvloom.kernels.moe_router_triton import (
    MAX_EXPERTS,
    PICKS_PER_ROUND,
    sigmoid_topk_triton,
    softmax_topk_triton,
)
from kvloom.workers.layers import moe
from tests.kernel_env import DEVICE, gpu, needs_cuda

MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
NAN, INF = float("nan"), float("inf")


def seed_of(*case) -> int:
    return zlib.crc32(repr(case).encode())


def distinct_logits(tokens, experts, dtype, seed, scale=2.0, device=DEVICE):
    """[T, E] logits whose values within a row are distinct in `dtype` (no ties)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(tokens):
        pool = (torch.randn(8 * experts + 64, generator=gen) * scale).to(dtype).unique()
        assert pool.numel() >= experts, "too few distinct values drawn"
        rows.append(pool[torch.randperm(pool.numel(), generator=gen)[:experts]])
    out = torch.stack(rows) if rows else torch.empty(0, experts, dtype=dtype)
    return out.to(device)


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units in the last place of `want` (half dtypes)."""
    bits = MANTISSA_BITS[want.dtype]
    w = want.double()
    _, exponent = torch.frexp(w)
    min_exp = -14 if want.dtype == torch.float16 else -126  # subnormal spacing floor
    ulp = torch.exp2((exponent - 1).clamp(min=min_exp).double() - bits)
    return (got.double() - w).abs() / ulp


def assert_weights_close(name, got, want):
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape)
    assert torch.isfinite(got).all(), f"{name}: non-finite weight"
    got, want = got.cpu(), want.cpu()
    if got.dtype == torch.float32:
        rel = ((got.double() - want.double()).abs() / want.double().abs()).max().item()
        print(f"ERRNORM {name}: max_rel={rel:.3e}")
        assert rel <= 2e-6, f"{name}: max relative error {rel:.3e}"
    else:
        err = ulps(got, want)
        differing = (got != want).float().mean().item()
        print(f"ERRNORM {name}: max_ulp={err.max().item():.0f} differing={differing:.2%}")
        assert err.max().item() <= 1, f"{name}: {err.max().item()} ulps"


def check_case(name, logits, top_k, renormalize):
    before = logits.clone()
    weights, ids = softmax_topk_triton(logits, top_k, renormalize)
    ref_w, ref_ids = softmax_topk_ref(logits, top_k, renormalize)
    assert ids.dtype == torch.int64 and ids.is_contiguous() and weights.is_contiguous()
    assert torch.equal(ids, ref_ids), f"{name}: expert ids differ"
    assert_weights_close(name, weights, ref_w)
    assert torch.equal(logits, before), f"{name}: the logits were written"
    return weights, ids


CASES = [
    # tokens, experts, top_k, renormalize, dtype
    (3, 8, 2, True, torch.float32),
    (3, 8, 2, False, torch.bfloat16),
    (1, 60, 4, True, torch.bfloat16),
    (2, 60, 4, False, torch.float32),
    (3, 512, 10, True, torch.bfloat16),
    (2, 512, 10, False, torch.bfloat16),
    (2, 512, 10, True, torch.float32),
    (2, 512, 10, False, torch.float16),
    (1, 1024, 8, True, torch.float32),
    (2, 5, 5, True, torch.float32),  # k = E
    (2, 1, 1, False, torch.bfloat16),  # one expert
    (4, 128, 1, False, torch.float16),  # k = 1
]


@pytest.mark.parametrize("tokens,experts,top_k,renormalize,dtype", CASES)
def test_matches_reference(tokens, experts, top_k, renormalize, dtype):
    case = (tokens, experts, top_k, renormalize, dtype)
    logits = distinct_logits(tokens, experts, dtype, seed_of(*case))
    check_case(f"T{tokens} E{experts} k{top_k} r{renormalize} {dtype}", logits, top_k, renormalize)


def test_strided_logits():
    """A column slice of a wider tensor, and a transposed (column-major) one."""
    wide = distinct_logits(3, 96, torch.bfloat16, seed=1)
    check_case("column slice", wide[:, 16:80], 6, True)
    col_major = distinct_logits(40, 3, torch.float32, seed=2).t()  # [3, 40], stride (1, 3)
    check_case("column-major", col_major, 5, False)


def test_ties_pick_the_lowest_expert_first():
    logits = torch.zeros(2, 16, device=DEVICE)
    logits[1, [3, 9, 12]] = 1.0  # a tie among the top three, then a 13-way tie
    weights, ids = softmax_topk_triton(logits, 5, False)
    assert ids.tolist() == [[0, 1, 2, 3, 4], [3, 9, 12, 0, 1]]
    assert torch.allclose(weights[0].cpu(), torch.full((5,), 1 / 16), rtol=1e-6, atol=0)
    ref_w, _ = softmax_topk_ref(logits, 5, False)
    assert_weights_close("ties", weights, ref_w)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf
def test_nan_and_infinite_logits():
    """NaN: the row's weights are NaN, its NaN experts rank first, ids stay in range and
    distinct; -inf experts have probability 0; other rows are untouched."""
    logits = distinct_logits(4, 12, torch.float32, seed=3)
    logits[0, [7, 2]] = NAN
    logits[1, :] = NAN
    logits[2, [0, 5, 6]] = -INF
    weights, ids = softmax_topk_triton(logits, 4, True)
    assert weights[:2].isnan().all()
    assert ids[0, :2].tolist() == [2, 7]
    for row in ids[:2].tolist():
        assert len(set(row)) == 4 and all(0 <= i < 12 for i in row)
    assert ids[1].tolist() == [0, 1, 2, 3]
    ref_w, ref_ids = softmax_topk_ref(logits[2:], 4, True)
    assert torch.equal(ids[2:], ref_ids)
    assert_weights_close("finite rows", weights[2:], ref_w)
    # -inf experts come last, with probability 0 (k covering all 12).
    weights, ids = softmax_topk_triton(logits[2:3], 12, False)
    assert sorted(ids[0, -3:].tolist()) == [0, 5, 6] and (weights[0, -3:] == 0).all()
    # A row of only -inf: softmax is NaN (as torch's), ids still in range.
    weights, ids = softmax_topk_triton(torch.full((1, 6), -INF, device=DEVICE), 3, False)
    assert weights.isnan().all() and ids.tolist() == [[0, 1, 2]]


def picks_cases():
    """Rows with ties, NaN, +-inf and a knocked-out lane's neighbours, odd and even k,
    k == E, with and without a shared route."""
    logits = distinct_logits(5, 24, torch.float32, seed=11)
    logits[1] = 0.5  # all tied: lowest ids first
    logits[2, [4, 17]] = NAN
    logits[3, [0, 9]] = INF
    logits[4, 3:9] = -INF
    for top_k in (1, 3, 8, 24):
        for renormalize in (False, True):
            yield logits, top_k, renormalize, None
    yield logits, 5, True, "one"
    yield logits.to(torch.bfloat16), 7, True, "sigmoid_last_logit"


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_two_picks_per_reduction_give_one_pick_s_bits():
    """The default plan (two keys from each max reduction, weights after the loop) picks
    the same experts in the same order with the same weight bits as one pick a reduction,
    for the softmax and the sigmoid routers."""
    assert PICKS_PER_ROUND == 2
    bias = torch.randn(24, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    for logits, top_k, renormalize, shared in picks_cases():
        experts = logits.shape[1] - (shared == "sigmoid_last_logit")
        top_k = min(top_k, experts)
        runs = [
            softmax_topk_triton(logits, top_k, renormalize, shared, picks_per_round=picks)
            for picks in (1, 2)
        ]
        runs += [
            sigmoid_topk_triton(
                logits, bias[:experts], top_k, renormalize, 2.5, shared, picks_per_round=picks
            )
            for picks in (1, 2)
        ]
        case = (logits.dtype, top_k, renormalize, shared)
        for one, two in (runs[:2], runs[2:]):
            assert torch.equal(one[1], two[1]), case
            assert torch.equal(one[0].view(torch.int8), two[0].view(torch.int8)), case
    with pytest.raises(ValueError, match="picks_per_round"):
        softmax_topk_triton(logits, 2, True, picks_per_round=3)


def test_empty_batch():
    weights, ids = softmax_topk_triton(torch.empty(0, 32, device=DEVICE), 4, True)
    assert weights.shape == (0, 4) and ids.shape == (0, 4) and ids.dtype == torch.int64


BAD_ARGS = [
    ("router_logits", lambda t: t[0], 2, True),
    ("router_logits", lambda t: t.double(), 2, True),
    ("router_logits", lambda t: t.to(torch.int32), 2, True),
    ("router_logits", lambda t: torch.zeros(2, MAX_EXPERTS + 1, device=t.device), 2, True),
    ("top_k", lambda t: t, 0, True),
    ("top_k", lambda t: t, 9, True),
    ("top_k", lambda t: t, True, True),
    ("top_k", lambda t: t, 2.0, True),
    ("renormalize", lambda t: t, 2, "yes"),
]


@pytest.mark.parametrize("field,breaker,top_k,renormalize", BAD_ARGS)
def test_bad_arguments_name_the_field(field, breaker, top_k, renormalize):
    logits = distinct_logits(2, 8, torch.float32, seed=4)
    softmax_topk_triton(logits, 2, True)  # the unbroken arguments are fine
    with pytest.raises(ValueError, match=f"^{field}"):
        softmax_topk_triton(breaker(logits), top_k, renormalize)


def test_layer_router_limit_matches_the_kernel():
    assert moe.MAX_ROUTER_EXPERTS == MAX_EXPERTS


@pytest.mark.parametrize("renormalize", [True, False])
def test_layer_router_float64_and_cpu_take_the_reference(renormalize):
    """route_softmax_topk off CUDA (and in float64) is the reference, bit for bit."""
    for dtype in (torch.float64, torch.bfloat16):
        logits = distinct_logits(5, 24, dtype, seed=5, device="cpu")
        weights, ids = moe.route_softmax_topk(logits, 3, renormalize)
        ref_w, ref_ids = softmax_topk_ref(logits, 3, renormalize)
        assert torch.equal(weights, ref_w) and torch.equal(ids, ref_ids)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_moe_reads_half_weights_as_their_float32_values(dtype):
    """FusedMoE no longer casts routing weights to float32 before the kernel: the kernel
    reads half-precision weights exactly, so the result is bitwise the same."""
    gen = torch.Generator().manual_seed(6)
    tokens, hidden, inter, experts, top_k = 3, 16, 8, 4, 2
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / 4).to(DEVICE, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / 3).to(DEVICE, dtype)
    logits = distinct_logits(tokens, experts, dtype, seed=7)
    weights, ids = softmax_topk_triton(logits, top_k, True)
    assert weights.dtype == dtype
    half = fused_moe_triton(x, w13, w2, weights, ids)
    single = fused_moe_triton(x, w13, w2, weights.float(), ids)
    assert torch.equal(half, single)


# ------------------------------------------------------------------------------------- gpu


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 8, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_qwen3_next_router_and_cuda_graph(tokens, dtype):
    experts, top_k = 512, 10
    logits = distinct_logits(tokens, experts, dtype, seed_of("gpu", tokens, dtype))
    check_case(f"gpu T{tokens} {dtype}", logits, top_k, True)
    check_case(f"gpu T{tokens} {dtype} no renorm", logits, top_k, False)
    # The layer's router takes the kernel on CUDA.
    weights, ids = softmax_topk_triton(logits, top_k, True)
    layer_w, layer_ids = moe.route_softmax_topk(logits, top_k, True)
    assert torch.equal(layer_w, weights) and torch.equal(layer_ids, ids)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_w, graph_ids = softmax_topk_triton(logits, top_k, True)
    logits.copy_(distinct_logits(tokens, experts, dtype, seed_of("gpu fresh", tokens, dtype)))
    graph.replay()
    torch.cuda.synchronize()
    eager_w, eager_ids = softmax_topk_triton(logits, top_k, True)
    assert torch.equal(graph_w, eager_w) and torch.equal(graph_ids, eager_ids)
    ref_w, ref_ids = softmax_topk_ref(logits, top_k, True)
    assert torch.equal(graph_ids, ref_ids)
    assert_weights_close(f"gpu T{tokens} {dtype} replay", graph_w, ref_w)


@gpu
@needs_cuda
def test_gpu_1024_experts():
    logits = distinct_logits(64, 1024, torch.bfloat16, seed=8)
    check_case("gpu E1024", logits, 16, True)


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 4, 300])
def test_gpu_two_picks_per_reduction_at_real_router_widths(tokens):
    """Compiled, at Qwen3-Next's router (512 experts + its shared gate column, top 10) and
    Kimi-Linear's (256, top 8, bias, scaled): both pick plans give the same ids and bits,
    and the default plan matches the reference."""
    logits = distinct_logits(tokens, 513, torch.bfloat16, seed_of("picks", tokens))
    runs = [
        softmax_topk_triton(logits, 10, True, "sigmoid_last_logit", picks_per_round=picks)
        for picks in (1, 2)
    ]
    kimi = distinct_logits(tokens, 256, torch.float32, seed_of("kimi picks", tokens))
    bias = torch.randn(256, device="cuda") / 10
    runs += [
        sigmoid_topk_triton(kimi, bias, 8, True, 2.446, "one", picks_per_round=picks)
        for picks in (1, 2)
    ]
    for one, two in (runs[:2], runs[2:]):
        assert torch.equal(one[1], two[1])
        assert torch.equal(one[0].view(torch.int8), two[0].view(torch.int8))
    check_case(f"gpu picks T{tokens}", logits[:, :512], 10, True)
