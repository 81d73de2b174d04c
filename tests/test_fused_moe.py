"""The fused mixture-of-experts kernel: its torch reference against the `FusedMoE` layer's
expert loop (float64), the Triton kernel against the reference, and invariant 7 (every
route block size gives bitwise the same output).

Without CUDA the Triton kernels run in the CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1) at tiny shapes; with CUDA the same tests run compiled, and the
`gpu`-marked ones add the benchmark shape (E=512, k=10, H=2048, I=512, bfloat16) and a
CUDA-graph capture. Workspaces are pre-filled with NaN (`_fill`), so an element read
before it is written shows up as NaN.

Tolerances (outputs are O(1) by construction): float32 1e-5, the two sides differ only
in float32 summation order; float16 2e-3 and bfloat16 1.6e-2, about one unit in the last
place of the output, where an activation element rounded to the other side of a
half-precision step (the interpreter also narrows float32 to bfloat16 by truncation,
not round-to-nearest as the GPU and torch do).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvloom.kernels.fused_moe import fused_moe_ref
from kvloom.kernels.fused_moe_triton import (
    BLOCK_M_CHOICES,
    align_routes,
    choose_block_m,
    fused_moe_triton,
    max_route_blocks,
)
from kvloom.workers.layers.moe import FusedMoE

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
NAN = float("nan")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_weights(num_experts, hidden, inter, dtype, seed, device=DEVICE):
    """w13 [E, 2I, H], w2 [E, H, I] scaled so each projection's outputs are O(1)."""
    g = gen(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / math.sqrt(hidden)
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / math.sqrt(inter)
    return w13.to(device, dtype), w2.to(device, dtype)


def make_routing(num_tokens, num_experts, top_k, seed, id_dtype=torch.int32, device=DEVICE):
    """Distinct experts per token (as routers give) and positive weights summing to 1."""
    g = gen(seed)
    ids = torch.rand(num_tokens, num_experts, generator=g).argsort(dim=1)[:, :top_k]
    weights = torch.rand(num_tokens, top_k, generator=g) + 0.05
    weights = weights / weights.sum(dim=1, keepdim=True)
    return weights.to(device), ids.to(device, id_dtype)


def make_hidden(num_tokens, hidden, dtype, seed, device=DEVICE):
    return torch.randn(num_tokens, hidden, generator=gen(seed)).to(device, dtype)


def check_close(name, actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert not torch.isnan(actual).any(), f"{name}: NaN in the kernel's output"
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    print(f"ERRNORM {name}: max_abs={err:.3e}")
    tol = TOL[dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


# ---------------------------------------------------------------- the reference


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "inter"),
    [(9, 6, 2, 24, 10), (1, 4, 1, 16, 8), (17, 5, 5, 12, 6)],
)
def test_reference_matches_layer_loop_float64(num_tokens, num_experts, top_k, hidden, inter):
    torch.manual_seed(3)
    layer = FusedMoE(num_experts, top_k, hidden, inter, dtype=torch.float64)
    with torch.no_grad():
        layer.w13.normal_()
        layer.w2.normal_()
    x = torch.randn(num_tokens, hidden, dtype=torch.float64)
    weights, ids = make_routing(num_tokens, num_experts, top_k, seed=4, device="cpu")
    weights = weights.double()
    expected = layer(x, weights, ids.long())
    got = fused_moe_ref(x, layer.w13, layer.w2, weights, ids)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_reference_rejects_out_of_range_ids():
    w13, w2 = make_weights(3, 8, 4, torch.float32, seed=0, device="cpu")
    x = make_hidden(2, 8, torch.float32, seed=1, device="cpu")
    ids = torch.tensor([[0, 3], [1, 2]])
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe_ref(x, w13, w2, torch.full((2, 2), 0.5), ids)


# ---------------------------------------------------------------- the route sort


def expected_alignment(ids: torch.Tensor, num_experts: int, block_m: int):
    """(sorted routes of the used blocks, block experts of the used blocks), by loops."""
    flat = ids.reshape(-1).tolist()
    sentinel = len(flat)
    routes, experts = [], []
    for e in range(num_experts):
        mine = [r for r, x in enumerate(flat) if x == e]
        blocks = -(-len(mine) // block_m)
        routes += mine + [sentinel] * (blocks * block_m - len(mine))
        experts += [e] * blocks
    return routes, experts


@pytest.mark.parametrize("block_m", BLOCK_M_CHOICES)
def test_align_routes_sorts_pads_and_marks_blocks(block_m):
    num_experts = 6
    # Counts 17, 1, 0, 33, 1, 0 (uneven, empty experts), ids out of range (-1, 6, 9),
    # stored int64 as every other column of a wider tensor (strided).
    counts = [17, 1, 0, 33, 1, 0]
    flat = [e for e, c in enumerate(counts) for _ in range(c)] + [-1, 6, 9]
    flat = torch.tensor(flat)[torch.randperm(len(flat), generator=gen(5))]
    pad = (-len(flat)) % 3
    flat = torch.cat([flat, torch.zeros(pad, dtype=torch.long)])  # expert 0 gets `pad` more
    wide = torch.stack([flat.view(-1, 3), torch.full((flat.numel() // 3, 3), 99)], dim=2)
    ids = wide.reshape(-1, 6)[:, 0::2].to(DEVICE)
    assert ids.stride(1) == 2
    sorted_routes, block_expert = align_routes(ids, num_experts, block_m, _fill=-7)
    max_blocks = max_route_blocks(ids.numel(), num_experts, block_m)
    assert sorted_routes.shape == (max_blocks * block_m,) and block_expert.shape == (max_blocks,)
    routes, experts = expected_alignment(ids.cpu(), num_experts, block_m)
    used = len(experts)
    assert block_expert[:used].tolist() == experts
    assert block_expert[used:].tolist() == [-1] * (max_blocks - used)
    assert sorted_routes[: used * block_m].tolist() == routes


def test_max_route_blocks_covers_the_worst_routing():
    # Worst case: every used expert has one route past a whole number of blocks.
    for block_m in BLOCK_M_CHOICES:
        for num_experts in (1, 3, 8):
            for per_expert in (1, block_m + 1, 2 * block_m + 1):
                routes = num_experts * per_expert
                need = num_experts * -(-per_expert // block_m)
                assert max_route_blocks(routes, num_experts, block_m) >= need
        assert max_route_blocks(5, 512, block_m) == 5  # at most N experts are used


def test_choose_block_m_by_tokens_per_expert():
    assert choose_block_m(1, 10, 512) == 16
    assert choose_block_m(256, 10, 512) == 16
    assert choose_block_m(4096, 8, 8) == 64
    picks = [choose_block_m(t, 2, 8) for t in range(0, 2048, 7)]
    assert picks == sorted(picks) and set(picks) <= set(BLOCK_M_CHOICES)


# ---------------------------------------------------------------- the kernel


def run_both(x, w13, w2, weights, ids, **kwargs):
    got = fused_moe_triton(x, w13, w2, weights, ids, _fill=NAN, **kwargs)
    expected = fused_moe_ref(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
    return got.cpu(), expected


DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (T, E, k, H, I): H = 80 and I = 72 are not multiples of the 64-wide tiles and span two.
SHAPES = [(1, 8, 2, 80, 72), (13, 7, 3, 80, 72), (6, 3, 1, 40, 24)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_reference(shape, dtype):
    num_tokens, num_experts, top_k, hidden, inter = shape
    w13, w2 = make_weights(num_experts, hidden, inter, dtype, seed=10)
    weights, ids = make_routing(num_tokens, num_experts, top_k, seed=11)
    x = make_hidden(num_tokens, hidden, dtype, seed=12)
    got, expected = run_both(x, w13, w2, weights, ids)
    check_close(f"fused_moe {shape} {dtype}", got, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_routes_on_one_expert_and_empty_experts(dtype):
    # 22 routes (both slots of every token, int64 ids) on expert 4: two blocks of 16;
    # experts 0-3 and 5 see no token.
    num_tokens, num_experts, hidden, inter = 11, 6, 40, 24
    w13, w2 = make_weights(num_experts, hidden, inter, dtype, seed=20)
    x = make_hidden(num_tokens, hidden, dtype, seed=21)
    ids = torch.full((num_tokens, 2), 4, dtype=torch.int64, device=DEVICE)
    weights = (torch.rand(num_tokens, 2, generator=gen(22)) + 0.05).to(DEVICE)
    got, expected = run_both(x, w13, w2, weights, ids, block_m=16)
    check_close(f"one expert {dtype}", got, expected, dtype)


def test_zero_tokens_gives_an_empty_output():
    w13, w2 = make_weights(4, 16, 8, torch.bfloat16, seed=30)
    x = torch.empty(0, 16, dtype=torch.bfloat16, device=DEVICE)
    ids = torch.empty(0, 2, dtype=torch.int32, device=DEVICE)
    out = fused_moe_triton(x, w13, w2, torch.empty(0, 2, device=DEVICE), ids)
    assert out.shape == (0, 16) and out.dtype == torch.bfloat16
    ref = fused_moe_ref(x.cpu(), w13.cpu(), w2.cpu(), torch.empty(0, 2), ids.cpu())
    assert ref.shape == (0, 16)


def test_out_of_range_ids_add_nothing():
    num_tokens, num_experts, top_k, hidden, inter = 5, 4, 3, 40, 24
    w13, w2 = make_weights(num_experts, hidden, inter, torch.float32, seed=40)
    weights, ids = make_routing(num_tokens, num_experts, top_k, seed=41)
    x = make_hidden(num_tokens, hidden, torch.float32, seed=42)
    bad = torch.zeros_like(ids, dtype=torch.bool)
    bad[0, 1] = bad[2, 0] = bad[4, 2] = True
    bad_ids = ids.clone()
    bad_ids[0, 1], bad_ids[2, 0], bad_ids[4, 2] = -1, num_experts, 1000
    got = fused_moe_triton(x, w13, w2, weights, bad_ids, _fill=NAN).cpu()
    # The same routes with weight 0 on a valid expert contribute exactly 0 in the reference.
    kept_ids = torch.where(bad, 0, ids).cpu()
    kept_weights = torch.where(bad, 0.0, weights).cpu()
    expected = fused_moe_ref(x.cpu(), w13.cpu(), w2.cpu(), kept_weights, kept_ids)
    check_close("out-of-range ids", got, expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_block_m_gives_bitwise_the_same_output(dtype):
    # 111 routes over 5 experts: 1 to 3 blocks per expert, at different sorted positions
    # for each block size.
    num_tokens, num_experts, top_k, hidden, inter = 37, 5, 3, 80, 72
    w13, w2 = make_weights(num_experts, hidden, inter, dtype, seed=50)
    weights, ids = make_routing(num_tokens, num_experts, top_k, seed=51)
    x = make_hidden(num_tokens, hidden, dtype, seed=52)
    outs = {m: fused_moe_triton(x, w13, w2, weights, ids, block_m=m) for m in BLOCK_M_CHOICES}
    outs[None] = fused_moe_triton(x, w13, w2, weights, ids)
    first = outs[BLOCK_M_CHOICES[0]]
    for block_m, out in outs.items():
        assert torch.equal(out, first), f"block_m={block_m} differs from {BLOCK_M_CHOICES[0]}"
    expected = fused_moe_ref(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
    check_close(f"block_m sweep {dtype}", first.cpu(), expected, dtype)


def bad_arg_cases():
    """(name, field, transform of the good argument dict)."""

    def with_(**changes):
        return lambda args: {**args, **changes}

    return [
        ("hidden 3-D", "hidden", lambda a: {**a, "hidden": a["hidden"][None]}),
        ("hidden float64", "hidden", lambda a: {**a, "hidden": a["hidden"].double()}),
        ("w13 odd rows", "w13", lambda a: {**a, "w13": a["w13"][:, :-1]}),
        ("w13 wrong H", "w13", lambda a: {**a, "w13": a["w13"][:, :, :-1]}),
        ("w13 dtype", "w13", lambda a: {**a, "w13": a["w13"].half()}),
        ("w2 wrong I", "w2", lambda a: {**a, "w2": a["w2"][:, :, :-1]}),
        ("w2 wrong E", "w2", lambda a: {**a, "w2": a["w2"][:-1]}),
        ("ids float", "topk_ids", lambda a: {**a, "topk_ids": a["topk_ids"].float()}),
        ("ids rows", "topk_ids", lambda a: {**a, "topk_ids": a["topk_ids"][:-1]}),
        ("ids no slot", "topk_ids", lambda a: {**a, "topk_ids": a["topk_ids"][:, :0]}),
        (
            "weights shape",
            "topk_weights",
            lambda a: {**a, "topk_weights": a["topk_weights"][:, :1]},
        ),
        ("weights int", "topk_weights", lambda a: {**a, "topk_weights": a["topk_ids"]}),
        ("hidden not tensor", "hidden", with_(hidden=[[1.0]])),
        ("block_m 48", "block_m", with_(block_m=48)),
        ("block_m bool", "block_m", with_(block_m=True)),
        ("block_m float", "block_m", with_(block_m=16.0)),
    ]


@pytest.mark.parametrize(("case", "field", "transform"), bad_arg_cases())
def test_bad_arguments_raise_naming_the_field(case, field, transform):
    w13, w2 = make_weights(3, 16, 8, torch.float32, seed=60)
    weights, ids = make_routing(4, 3, 2, seed=61)
    good = dict(
        hidden=make_hidden(4, 16, torch.float32, seed=62),
        w13=w13,
        w2=w2,
        topk_weights=weights,
        topk_ids=ids,
    )
    with pytest.raises(ValueError, match=field):
        fused_moe_triton(**transform(good))


# ---------------------------------------------------------------- CUDA


def benchmark_inputs(num_tokens, w13, seed):
    num_experts, hidden = w13.shape[0], w13.shape[2]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=g)
    weights, ids = torch.softmax(logits, dim=-1).topk(10, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return x, weights, ids.to(torch.int32)


@pytest.mark.gpu
def test_benchmark_shape_on_gpu_bitwise_across_plans_and_in_a_cuda_graph():
    if not CUDA:
        pytest.skip("needs a CUDA GPU")
    num_experts, hidden, inter = 512, 2048, 512
    g = torch.Generator(device="cuda").manual_seed(70)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=g)
    w13 = (w13 / math.sqrt(hidden)).to(torch.bfloat16)
    w2 = torch.randn(num_experts, hidden, inter, device="cuda", generator=g)
    w2 = (w2 / math.sqrt(inter)).to(torch.bfloat16)
    for num_tokens in (1, 64, 256):
        x, weights, ids = benchmark_inputs(num_tokens, w13, seed=num_tokens)
        out = fused_moe_triton(x, w13, w2, weights, ids, _fill=NAN)
        expected = fused_moe_ref(x, w13, w2, weights, ids)
        check_close(f"gpu T={num_tokens}", out, expected, torch.bfloat16)
        for block_m in BLOCK_M_CHOICES:
            plan = fused_moe_triton(x, w13, w2, weights, ids, block_m=block_m)
            assert torch.equal(plan, out), f"T={num_tokens}: block_m={block_m} differs"

        # Capture once, then replay on new tokens and new routing copied into the inputs.
        static = [t.clone() for t in (x, weights, ids)]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fused_moe_triton(static[0], w13, w2, static[1], static[2])  # compile, warm up
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_out = fused_moe_triton(static[0], w13, w2, static[1], static[2])
        new = benchmark_inputs(num_tokens, w13, seed=1000 + num_tokens)
        for dst, src in zip(static, new):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        eager = fused_moe_triton(*new[:1], w13, w2, *new[1:])
        assert torch.equal(graph_out, eager), f"T={num_tokens}: graph replay differs"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_mid_shape_each_dtype(dtype):
    if not CUDA:
        pytest.skip("needs a CUDA GPU")
    num_tokens, num_experts, top_k, hidden, inter = 300, 60, 4, 320, 200
    w13, w2 = make_weights(num_experts, hidden, inter, dtype, seed=80)
    weights, ids = make_routing(num_tokens, num_experts, top_k, seed=81, id_dtype=torch.int64)
    x = make_hidden(num_tokens, hidden, dtype, seed=82)
    got, expected = run_both(x, w13, w2, weights, ids)
    check_close(f"gpu mid {dtype}", got, expected, dtype)
    outs = [fused_moe_triton(x, w13, w2, weights, ids, block_m=m) for m in BLOCK_M_CHOICES]
    assert all(torch.equal(o, outs[0]) for o in outs)
