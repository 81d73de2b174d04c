"""The fused MoE's pairs (decode) plan: every (token, slot) route is a route block of its
own, its expert read from topk_ids, so the route sort's count and place launches go.

Invariant 7: the pairs plan must give bitwise the sorted plans' output at every token
count. Without CUDA the kernels run in Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1) at tiny shapes; with CUDA the same tests run compiled, and the
`gpu`-marked ones add Qwen3-Next's MoE shape (512 experts + the folded shared expert, top
10 + 1, hidden 2048, intermediate 512), the automatic plan choice, the launch count seen
by the profiler and a CUDA-graph capture.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvloom.kernels import dispatch
from kvloom.kernels import fused_moe_triton as fused_moe_triton_module
from kvloom.kernels.fused_moe import fused_moe_ref
from kvloom.kernels.fused_moe_triton import (
    BLOCK_M_CHOICES,
    PAIRS_BLOCK_M,
    PAIRS_PLAN_MAX_TOKENS,
    choose_block_m,
    fused_moe_triton,
    pairs_stages,
    slot_counters,
    uses_pairs_plan,
    uses_slot_sum,
)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
HALF = [torch.float16, torch.bfloat16]
NAN = float("nan")
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # as tests/test_fused_moe.py


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_weights(num_experts, hidden, inter, dtype, seed, device=DEVICE):
    g = gen(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / math.sqrt(hidden)
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / math.sqrt(inter)
    return w13.to(device, dtype), w2.to(device, dtype)


def make_routing(num_tokens, num_routed, top_k, seed, shared=False, device=DEVICE):
    """Distinct routed experts per token from a pool of 3 so tokens share experts; with
    `shared`, slot k is the folded shared expert, id `num_routed`, for every token."""
    g = gen(seed)
    pool = torch.randperm(num_routed, generator=g)[: max(3, top_k)]
    picks = torch.rand(num_tokens, pool.numel(), generator=g).argsort(dim=1)[:, :top_k]
    ids = pool[picks]
    if shared:
        ids = torch.cat([ids, torch.full((num_tokens, 1), num_routed)], dim=1)
    weights = torch.rand(ids.shape, generator=g) + 0.05
    return weights.to(device), ids.to(device, torch.int32)


def both_plans(x, w13, w2, weights, ids):
    """(pairs plan, every sorted plan by block_m), workspaces NaN-filled."""
    pairs = fused_moe_triton(x, w13, w2, weights, ids, pairs=True, _fill=NAN)
    sorted_plans = {
        m: fused_moe_triton(x, w13, w2, weights, ids, block_m=m, pairs=False, _fill=NAN)
        for m in BLOCK_M_CHOICES
    }
    return pairs, sorted_plans


def assert_bitwise(label, pairs, sorted_plans):
    assert not torch.isnan(pairs).any(), f"{label}: NaN (an unwritten element was read)"
    for block_m, out in sorted_plans.items():
        assert torch.equal(pairs, out), f"{label}: pairs plan differs from block_m={block_m}"


# ---------------------------------------------------------------- bitwise, interpreted


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("top_k", [1, 3])
@pytest.mark.parametrize("shared", [False, True])
def test_pairs_plan_is_bitwise_the_sorted_plans(dtype, top_k, shared):
    # H = 80, I = 72: two 64-wide tiles each, the second partial. Experts shared across
    # tokens (a pool of 3), the folded shared expert E in the last slot.
    num_routed, hidden, inter = 5, 80, 72
    w13, w2 = make_weights(num_routed + shared, hidden, inter, dtype, seed=1)
    for num_tokens in range(1, PAIRS_PLAN_MAX_TOKENS + 3):
        weights, ids = make_routing(num_tokens, num_routed, top_k, seed=num_tokens, shared=shared)
        x = torch.randn(num_tokens, hidden, generator=gen(100 + num_tokens)).to(DEVICE, dtype)
        pairs, sorted_plans = both_plans(x, w13, w2, weights, ids)
        assert_bitwise(f"T={num_tokens} k={top_k} shared={shared}", pairs, sorted_plans)
        ref = fused_moe_ref(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
        torch.testing.assert_close(pairs.cpu(), ref, rtol=TOL[dtype], atol=TOL[dtype])


def test_pairs_plan_reads_strided_int64_ids_and_half_weights():
    num_tokens, num_experts, top_k, hidden, inter = 3, 4, 2, 40, 24
    w13, w2 = make_weights(num_experts, hidden, inter, torch.bfloat16, seed=2)
    weights, ids = make_routing(num_tokens, num_experts, top_k, seed=3)
    wide = torch.stack([ids.long(), torch.full_like(ids.long(), 99)], dim=2).reshape(3, 4)
    strided_ids = wide[:, 0::2]
    assert strided_ids.stride(1) == 2 and strided_ids.dtype == torch.int64
    x = torch.randn(num_tokens, hidden, generator=gen(4)).to(DEVICE, torch.bfloat16)
    half_weights = weights.to(torch.bfloat16)
    pairs, sorted_plans = both_plans(x, w13, w2, half_weights, strided_ids)
    assert_bitwise("strided int64 ids", pairs, sorted_plans)


def test_pairs_plan_drops_out_of_range_ids_as_the_sorted_plan_does():
    num_tokens, num_experts, top_k, hidden, inter = 3, 4, 3, 40, 24
    w13, w2 = make_weights(num_experts, hidden, inter, torch.float16, seed=5)
    weights, ids = make_routing(num_tokens, num_experts, top_k, seed=6)
    ids[0, 1], ids[1, 0], ids[2, 2] = -1, num_experts, 1000
    x = torch.randn(num_tokens, hidden, generator=gen(7)).to(DEVICE, torch.float16)
    pairs, sorted_plans = both_plans(x, w13, w2, weights, ids)
    assert_bitwise("out-of-range ids", pairs, sorted_plans)


def test_pairs_plan_takes_only_the_narrow_block():
    w13, w2 = make_weights(3, 16, 8, torch.float16, seed=8)
    weights, ids = make_routing(2, 3, 2, seed=9)
    x = torch.randn(2, 16).to(DEVICE, torch.float16)
    with pytest.raises(ValueError, match="block_m"):
        fused_moe_triton(x, w13, w2, weights, ids, block_m=32, pairs=True)
    out = fused_moe_triton(x, w13, w2, weights, ids, block_m=PAIRS_BLOCK_M, pairs=True)
    assert torch.equal(out, fused_moe_triton(x, w13, w2, weights, ids, pairs=False))


# ---------------------------------------------------------------- the in-launch slot sum


def slot_sum_and_launches(x, w13, w2, weights, ids):
    """(pairs plan with its slots summed in the down launch, the same with the slot-sum
    launch), workspaces NaN-filled."""
    fused = fused_moe_triton(x, w13, w2, weights, ids, pairs=True, slot_sum=True, _fill=NAN)
    apart = fused_moe_triton(x, w13, w2, weights, ids, pairs=True, slot_sum=False, _fill=NAN)
    return fused, apart


def assert_counters_reset(hidden_size, device=DEVICE):
    counters = slot_counters(torch.device(device), 1, math.ceil(hidden_size / 64))
    assert not counters.any(), "the slot sum left an arrival counter set"


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("top_k", [1, 3])
@pytest.mark.parametrize("shared", [False, True])
def test_slot_sum_in_the_down_launch_is_bitwise_the_sum_launch(dtype, top_k, shared):
    """Each token's k slots summed by the last of its down programs to store: the bits
    of the slot-sum launch (and so of the sorted plans), twice in a row on the same
    counters (the summing program resets them)."""
    num_routed, hidden, inter = 5, 80, 72  # two 64-wide column tiles, the second partial
    w13, w2 = make_weights(num_routed + shared, hidden, inter, dtype, seed=1)
    for num_tokens in range(1, PAIRS_PLAN_MAX_TOKENS + 3):
        weights, ids = make_routing(num_tokens, num_routed, top_k, seed=num_tokens, shared=shared)
        x = torch.randn(num_tokens, hidden, generator=gen(100 + num_tokens)).to(DEVICE, dtype)
        for attempt in range(2):
            fused, apart = slot_sum_and_launches(x, w13, w2, weights, ids)
            label = f"T={num_tokens} k={top_k} shared={shared} call {attempt}"
            assert not torch.isnan(fused).any(), label
            assert torch.equal(fused, apart), label
            assert_counters_reset(hidden)


def test_slot_sum_drops_out_of_range_ids_as_the_sum_launch_does():
    """A slot whose expert is out of range stores nothing but still arrives, so its
    token's sum is still made (without it)."""
    num_tokens, num_experts, top_k, hidden, inter = 3, 4, 3, 40, 24
    w13, w2 = make_weights(num_experts, hidden, inter, torch.bfloat16, seed=5)
    weights, ids = make_routing(num_tokens, num_experts, top_k, seed=6)
    ids[0, 1], ids[1, 0], ids[2, 2] = -1, num_experts, 1000
    ids[1, 1] = ids[1, 2] = -3  # a token with one placed slot
    x = torch.randn(num_tokens, hidden, generator=gen(7)).to(DEVICE, torch.bfloat16)
    fused, apart = slot_sum_and_launches(x, w13, w2, weights, ids)
    assert not torch.isnan(fused).any() and torch.equal(fused, apart)
    assert_counters_reset(hidden)


def test_slot_sum_launches_two_kernels_and_needs_the_pairs_plan():
    if CUDA:
        pytest.skip("counts interpreted launches")
    w13, w2 = make_weights(5, 40, 24, torch.bfloat16, seed=10)
    weights, ids = make_routing(2, 4, 2, seed=11, shared=True)
    x = torch.randn(2, 40).to(torch.bfloat16)
    fused_moe_triton(x, w13, w2, weights, ids, pairs=True, slot_sum=True)  # its counters
    with recorded_launches() as ops:
        out = fused_moe_triton(x, w13, w2, weights, ids, pairs=True, slot_sum=True)
    assert ops == ["_gate_up_kernel", "_down_kernel"]
    assert torch.equal(out, fused_moe_triton(x, w13, w2, weights, ids, pairs=False))
    with pytest.raises(ValueError, match="slot_sum"):
        fused_moe_triton(x, w13, w2, weights, ids, pairs=False, slot_sum=True)


def test_slot_sum_is_the_default_on_a_gpu(monkeypatch):
    monkeypatch.delenv("KVLOOM_FUSED", raising=False)
    monkeypatch.delenv("KVLOOM_UNFUSED", raising=False)
    assert uses_slot_sum(fake_hidden(1), pairs=True)
    assert not uses_slot_sum(fake_hidden(1), pairs=False)
    assert not uses_slot_sum(fake_hidden(1, is_cuda=False), pairs=True)
    monkeypatch.setenv("KVLOOM_UNFUSED", "moe_slot_sum")
    assert not uses_slot_sum(fake_hidden(1), pairs=True)


# ---------------------------------------------------------------- the plan choice


def fake_hidden(num_tokens, dtype=torch.bfloat16, is_cuda=True):
    """What uses_pairs_plan reads of hidden, for a CUDA tensor this machine may lack."""
    return SimpleNamespace(shape=(num_tokens, 64), dtype=dtype, is_cuda=is_cuda)


def test_pairs_plan_choice_by_shape_device_dtype_and_mode(monkeypatch):
    # Qwen3-Next: 512 experts + shared, top 10 + 1: the sorted plan's narrow block at
    # every size the pairs plan serves.
    for num_tokens in range(1, PAIRS_PLAN_MAX_TOKENS + 1):
        sorted_block_m = choose_block_m(num_tokens, 11, 513)
        assert sorted_block_m == PAIRS_BLOCK_M
        assert uses_pairs_plan(fake_hidden(num_tokens), sorted_block_m)
    assert not uses_pairs_plan(fake_hidden(PAIRS_PLAN_MAX_TOKENS + 1), PAIRS_BLOCK_M)
    assert not uses_pairs_plan(fake_hidden(0), PAIRS_BLOCK_M)
    assert uses_pairs_plan(fake_hidden(1, torch.float16), PAIRS_BLOCK_M)
    # A wider sorted block, float32, CPU tensors and deterministic mode keep the sorted plans.
    assert not uses_pairs_plan(fake_hidden(1), 32)
    assert not uses_pairs_plan(fake_hidden(1, torch.float32), PAIRS_BLOCK_M)
    assert not uses_pairs_plan(fake_hidden(1, is_cuda=False), PAIRS_BLOCK_M)
    monkeypatch.setattr(dispatch, "_batch_invariant", True)
    assert not uses_pairs_plan(fake_hidden(1), PAIRS_BLOCK_M)


# ---------------------------------------------------------------- launches


class LaunchRecorder(TorchDispatchMode):
    """Interpreted Triton launches by kernel name, and torch ops outside them that a GPU
    would run as kernels (allocations launch nothing)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.inside_kernel = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside_kernel and name not in ("empty", "empty_strided"):
            self.ops.append(f"aten.{name}")
        return func(*args, **(kwargs or {}))


@contextmanager
def recorded_launches():
    from triton.runtime.interpreter import InterpretedFunction

    recorder = LaunchRecorder()
    original = InterpretedFunction.__getitem__

    def counted(kernel, grid):
        launch = original(kernel, grid)

        def run(*args, **kwargs):
            recorder.ops.append(kernel.fn.__name__)
            recorder.inside_kernel = True
            try:
                return launch(*args, **kwargs)
            finally:
                recorder.inside_kernel = False

        return run

    InterpretedFunction.__getitem__ = counted
    try:
        with recorder:
            yield recorder.ops
    finally:
        InterpretedFunction.__getitem__ = original


def test_pairs_plan_launches_three_kernels_where_the_sorted_plan_launches_five():
    if CUDA:
        pytest.skip("counts interpreted launches (the gpu test counts compiled ones)")
    w13, w2 = make_weights(5, 40, 24, torch.bfloat16, seed=10)
    weights, ids = make_routing(2, 4, 2, seed=11, shared=True)
    x = torch.randn(2, 40).to(torch.bfloat16)
    with recorded_launches() as pairs_ops:
        pairs = fused_moe_triton(x, w13, w2, weights, ids, pairs=True)
    with recorded_launches() as sorted_ops:
        # pairs=None on a CPU tensor: the sorted plan, as before the pairs plan existed.
        sorted_out = fused_moe_triton(x, w13, w2, weights, ids)
    assert pairs_ops == ["_gate_up_kernel", "_down_kernel", "_sum_slots_kernel"]
    assert sorted_ops == [
        "_count_routes_kernel",
        "_place_routes_kernel",
        "_gate_up_kernel",
        "_down_kernel",
        "_sum_slots_kernel",
    ]
    assert torch.equal(pairs, sorted_out)


@pytest.mark.parametrize(
    "setting,tokens,want",
    [("", 1, (6, 6)), ("", 2, (3, 3)), ("", 4, (3, 3)), ("4", 1, (4, 4)), ("8,4", 2, (8, 4)),
     (" 5 , 2 ", 1, (5, 2))],
)  # fmt: skip
def test_pairs_plan_pipelines_at_the_depths_asked_and_the_sorted_plan_keeps_its_own(
    monkeypatch, setting, tokens, want
):
    """The pairs plan pipelines deeper at one token than at more (here a grid of fewer
    programs than the interpreter's SMs: PAIRS_STAGES_FEW_PROGRAMS); KVLOOM_MOE_DECODE_STAGES
    sets its gate_up and down num_stages at any count (same bits: the interpreter ignores
    depth; the gpu test compares compiled depths)."""
    if CUDA:
        pytest.skip("reads interpreted launches' arguments")
    from triton.runtime.interpreter import InterpretedFunction

    monkeypatch.setenv("KVLOOM_MOE_DECODE_STAGES", setting)
    seen = []
    original = InterpretedFunction.__getitem__

    def recording(kernel, grid):
        launch = original(kernel, grid)

        def run(*args, **kwargs):
            seen.append((kernel.fn.__name__, kwargs.get("num_stages")))
            return launch(*args, **kwargs)

        return run

    monkeypatch.setattr(InterpretedFunction, "__getitem__", recording)
    w13, w2 = make_weights(5, 40, 24, torch.bfloat16, seed=12)
    weights, ids = make_routing(tokens, 4, 2, seed=13)
    x = torch.randn(tokens, 40).to(torch.bfloat16)
    pairs = fused_moe_triton(x, w13, w2, weights, ids, pairs=True)
    stages = dict(seen)
    assert (stages["_gate_up_kernel"], stages["_down_kernel"]) == want
    seen.clear()
    assert torch.equal(fused_moe_triton(x, w13, w2, weights, ids, pairs=False), pairs)
    assert dict(seen)["_gate_up_kernel"] == dict(seen)["_down_kernel"] == 3


def test_one_token_depth_follows_the_gate_up_grid_against_the_sms(monkeypatch):
    """At one token a gate_up grid that leaves SMs idle pipelines at depth 6 (Qwen3-Next:
    88 programs on an H100's 132 SMs), a fuller one at 4 (Kimi-Linear: 144); more tokens
    at 3; the variable overrides every case. The launch counts the grid against the SMs
    (the interpreter's 8) for half precision only."""
    monkeypatch.delenv("KVLOOM_MOE_DECODE_STAGES", raising=False)
    assert pairs_stages(1, idle_sms=True) == (6, 6)
    assert pairs_stages(1, idle_sms=False) == (4, 4)
    assert pairs_stages(2, idle_sms=True) == pairs_stages(4, idle_sms=False) == (3, 3)
    monkeypatch.setenv("KVLOOM_MOE_DECODE_STAGES", "5")
    assert pairs_stages(1, True) == pairs_stages(1, False) == (5, 5)
    monkeypatch.delenv("KVLOOM_MOE_DECODE_STAGES")
    seen = []
    monkeypatch.setattr(
        fused_moe_triton_module, "pairs_stages",
        lambda tokens, idle: (seen.append(idle), pairs_stages(tokens, idle))[1],
    )  # fmt: skip
    w13, w2 = make_weights(9, 40, 200, torch.bfloat16, seed=14)
    for top_k, want in ((2, True), (3, False)):  # 2 x 4 = 8 programs: 8 SMs; 3 x 4 = 12
        weights, ids = make_routing(1, 9, top_k, seed=15)
        x = torch.randn(1, 40).to(DEVICE, torch.bfloat16)
        fused_moe_triton(x, w13, w2, weights, ids, pairs=True)
        if CUDA:
            want = top_k * 4 <= fused_moe_triton_module.sm_count(x.device)
        assert seen[-1] == want, top_k
    x32 = torch.randn(1, 40).to(DEVICE)
    fused_moe_triton(x32, w13.float(), w2.float(), weights[:, :2], ids[:, :2], pairs=True)
    assert seen[-1] is False  # float32 tiles never go to depth 6


@pytest.mark.parametrize("bad", ["0", "6,4,2", "x", "17"])
def test_a_bad_decode_depth_names_the_variable(monkeypatch, bad):
    monkeypatch.setenv("KVLOOM_MOE_DECODE_STAGES", bad)
    with pytest.raises(ValueError, match="KVLOOM_MOE_DECODE_STAGES: expected one or two"):
        pairs_stages(1, True)


# ---------------------------------------------------------------- CUDA


def qwen3_next_experts(dtype, seed=70):
    """512 routed experts + the folded shared expert (id 512), hidden 2048, inter 512,
    drawn on the GPU (CPU draws of 1.6e9 values take long)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(513, 2 * 512, 2048, device="cuda", generator=g) / math.sqrt(2048)
    w2 = torch.randn(513, 2048, 512, device="cuda", generator=g) / math.sqrt(512)
    return w13.to(dtype), w2.to(dtype)


def qwen3_next_routing(num_tokens, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(num_tokens, 512, device="cuda", generator=g)
    weights, ids = torch.softmax(logits, dim=-1).topk(10, dim=-1)
    shared = torch.full((num_tokens, 1), 512, device="cuda")
    ids = torch.cat([ids, shared], dim=1).to(torch.int32)
    weights = torch.cat([weights, torch.sigmoid(logits[:, :1])], dim=1)
    return weights, ids


def cuda_kernel_names(*args) -> list[str]:
    """The kernels one fused_moe_triton(*args) call launches, by the profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fused_moe_triton(*args)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    return [n for n in names if not n.startswith(("Memcpy", "Memset"))]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HALF)
def test_gpu_pairs_plan_bitwise_at_qwen3_next_shape(dtype):
    if not CUDA:
        pytest.skip("needs a CUDA GPU")
    w13, w2 = qwen3_next_experts(dtype)
    for num_tokens in range(1, 2 * PAIRS_PLAN_MAX_TOKENS + 1):
        weights, ids = qwen3_next_routing(num_tokens, seed=num_tokens)
        x = torch.randn(num_tokens, 2048, generator=gen(num_tokens)).to("cuda", dtype)
        pairs, sorted_plans = both_plans(x, w13, w2, weights, ids)
        assert_bitwise(f"gpu T={num_tokens} {dtype}", pairs, sorted_plans)
        auto = fused_moe_triton(x, w13, w2, weights, ids)
        assert torch.equal(auto, pairs)
        ref = fused_moe_ref(x, w13, w2, weights, ids)
        torch.testing.assert_close(pairs, ref, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("stages", ["4", "6,4", "8", "8,8"])
def test_gpu_pairs_plan_bitwise_at_every_pipelining_depth(monkeypatch, stages):
    """Qwen3-Next's widths: the pairs plan at another KVLOOM_MOE_DECODE_STAGES depth gives
    the sorted plan's bits."""
    if not CUDA:
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("KVLOOM_MOE_DECODE_STAGES", stages)
    w13, w2 = qwen3_next_experts(torch.bfloat16)
    for num_tokens in (1, 2, PAIRS_PLAN_MAX_TOKENS):
        weights, ids = qwen3_next_routing(num_tokens, seed=30 + num_tokens)
        x = torch.randn(num_tokens, 2048, generator=gen(num_tokens)).to("cuda", torch.bfloat16)
        pairs, sorted_plans = both_plans(x, w13, w2, weights, ids)
        assert_bitwise(f"gpu stages {stages} T={num_tokens}", pairs, sorted_plans)


@pytest.mark.gpu
def test_gpu_pairs_plan_repeated_experts_and_top1():
    if not CUDA:
        pytest.skip("needs a CUDA GPU")
    for top_k in (1, 4):
        w13, w2 = make_weights(9, 320, 200, torch.bfloat16, seed=80 + top_k)
        for num_tokens in range(1, PAIRS_PLAN_MAX_TOKENS + 2):
            weights, ids = make_routing(num_tokens, 8, top_k, seed=num_tokens, shared=True)
            x = torch.randn(num_tokens, 320, generator=gen(num_tokens)).to("cuda", torch.bfloat16)
            pairs, sorted_plans = both_plans(x, w13, w2, weights, ids)
            assert_bitwise(f"gpu k={top_k} T={num_tokens}", pairs, sorted_plans)


@pytest.mark.gpu
def test_gpu_slot_sum_is_bitwise_the_sum_launch_racing_and_replayed():
    """Compiled, the k down programs of a token race to its counter: 30 calls at each
    token count (Qwen3-Next's widths), then 30 replays of a captured graph on new routing,
    each the slot-sum launch's bits, the counters back at 0 after each."""
    if not CUDA:
        pytest.skip("needs a CUDA GPU")
    w13, w2 = qwen3_next_experts(torch.bfloat16)
    for num_tokens in range(1, PAIRS_PLAN_MAX_TOKENS + 1):
        weights, ids = qwen3_next_routing(num_tokens, seed=50 + num_tokens)
        x = torch.randn(num_tokens, 2048, generator=gen(num_tokens)).to("cuda", torch.bfloat16)
        want = fused_moe_triton(x, w13, w2, weights, ids, pairs=True, slot_sum=False)
        for attempt in range(30):
            got = fused_moe_triton(x, w13, w2, weights, ids, pairs=True, slot_sum=True)
            assert torch.equal(got, want), f"T={num_tokens} call {attempt}"
        assert_counters_reset(2048, "cuda")

        static = [t.clone() for t in (x, weights, ids)]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fused_moe_triton(*static[:1], w13, w2, *static[1:], pairs=True, slot_sum=True)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_out = fused_moe_triton(
                static[0], w13, w2, static[1], static[2], pairs=True, slot_sum=True
            )
        for replay in range(30):
            new_w, new_ids = qwen3_next_routing(num_tokens, seed=2000 + replay)
            new_x = torch.randn(num_tokens, 2048, generator=gen(3000 + replay))
            for dst, src in zip(static, (new_x.to("cuda", torch.bfloat16), new_w, new_ids)):
                dst.copy_(src)
            graph.replay()
            want = fused_moe_triton(*static[:1], w13, w2, *static[1:], pairs=True, slot_sum=False)
            assert torch.equal(graph_out, want), f"T={num_tokens} replay {replay}"
        assert_counters_reset(2048, "cuda")


@pytest.mark.gpu
def test_gpu_auto_plan_launches_and_cuda_graph(monkeypatch):
    if not CUDA:
        pytest.skip("needs a CUDA GPU")
    w13, w2 = qwen3_next_experts(torch.bfloat16)
    for num_tokens in (1, PAIRS_PLAN_MAX_TOKENS, PAIRS_PLAN_MAX_TOKENS + 1):
        weights, ids = qwen3_next_routing(num_tokens, seed=10 + num_tokens)
        x = torch.randn(num_tokens, 2048, generator=gen(num_tokens)).to("cuda", torch.bfloat16)
        fused_moe_triton(x, w13, w2, weights, ids)  # compile
        names = cuda_kernel_names(x, w13, w2, weights, ids)
        sorts = [n for n in names if "routes_kernel" in n]
        if num_tokens <= PAIRS_PLAN_MAX_TOKENS:  # the slot sum (default) drops a launch
            assert len(names) == (2 if uses_slot_sum(x, True) else 3) and not sorts, names
        else:
            assert len(names) == 5 and len(sorts) == 2, names

        static = [t.clone() for t in (x, weights, ids)]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fused_moe_triton(static[0], w13, w2, static[1], static[2])
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_out = fused_moe_triton(static[0], w13, w2, static[1], static[2])
        new_w, new_ids = qwen3_next_routing(num_tokens, seed=1000 + num_tokens)
        new_x = torch.randn_like(x)
        for dst, src in zip(static, (new_x, new_w, new_ids)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        eager = fused_moe_triton(new_x, w13, w2, new_w, new_ids, pairs=False)
        assert torch.equal(graph_out, eager), f"T={num_tokens}: graph replay differs"
    # Deterministic mode keeps the sorted plan at decode sizes.
    monkeypatch.setattr(dispatch, "_batch_invariant", True)
    names = cuda_kernel_names(x[:1], w13, w2, weights[:1], ids[:1])
    assert len(names) == 5, names
