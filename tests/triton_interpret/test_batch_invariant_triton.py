"""The deterministic mode's batch-invariant kernels (kernels/batch_invariant*.py).

Each kernel gives a row bitwise the same numbers computed alone as inside batches of other
sizes (or, for the linear-attention loops and paged attention, whatever the chunking:
one prefill, split prefill chunks, decode steps), and matches its torch reference within
a tolerance. Interpreted on the CPU (TRITON_INTERPRET=1, tiny shapes), compiled on a GPU;
the `gpu` test adds model widths in bfloat16.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvloom.kernels.batch_invariant import (
    attention_plan,
    linear_ref,
    serial_causal_conv1d_ref,
    serial_gated_delta_rule_ref,
    serial_kda_ref,
)
from kvloom.kernels.batch_invariant_triton import (
    MATMUL_PLAN,
    SERIAL_WARPS,
    SM90_MATMUL_PLANS,
    matmul_plan,
    matmul_triton,
    serial_causal_conv1d_triton,
    serial_gated_delta_rule_triton,
    serial_recurrence_tiling,
)
from kvloom.kernels.paged_attention import paged_attention_ref
from kvloom.kernels.paged_attention_triton import paged_attention_triton
from tests.kernel_env import CUDA, DEVICE, gpu, needs_cuda

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(
    not CUDA and not INTERPRETED,
    reason="triton was imported for the compiler first and there is no GPU",
)
HALF = (torch.bfloat16, torch.float16)


def rand(*shape, seed, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _assert_rows_invariant(fn, x, sizes):
    """fn(x[:m])[probe rows] is bitwise fn(x)[same rows] for every batch size m."""
    full = fn(x)
    for m in sizes:
        part = fn(x[:m])
        assert torch.equal(part, full[:m]), f"rows differ between a batch of {m} and {len(x)}"
    alone = torch.cat([fn(x[i : i + 1]) for i in range(min(len(x), 3))])
    assert torch.equal(alone, full[: len(alone)]), "a row alone differs from it in a batch"
    return full


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_matmul_rows_do_not_depend_on_the_batch(dtype, bias):
    m, n, k = 70, 40, 80  # > one tile of rows; n, k not multiples of the tile
    x = rand(m, k, seed=1, dtype=dtype)
    w = rand(n, k, seed=2, dtype=dtype, scale=0.2)
    b = rand(n, seed=3, dtype=dtype) if bias else None
    out = _assert_rows_invariant(lambda t: matmul_triton(t, w, b), x, (1, 2, 5, 64, 65))
    ref = linear_ref(x, w, b)
    tol = 2e-2 if dtype in HALF else 1e-5
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_matmul_plan_by_rows_only_on_hopper_in_half_precision():
    """Hopper picks a tile by M (same bits, measured); everything else keeps the one plan."""
    bf16 = torch.bfloat16
    picked = [matmul_plan(m, (9, 0), bf16) for m in (1, 128, 129, 512, 513, 8192)]
    assert picked[0] == picked[1] and picked[2] == picked[3] and picked[4] == picked[5]
    assert picked[0] != picked[2] != picked[4]
    assert {p["BLOCK_M"] for p in picked} == {64, 128}
    for capability, dtype in (
        ((8, 0), bf16),
        ((10, 0), bf16),
        (None, bf16),
        ((9, 0), torch.float32),
    ):
        assert all(matmul_plan(m, capability, dtype) == MATMUL_PLAN for m in (1, 300, 8192))


def test_every_plan_gives_the_one_plans_bits():
    """The tiles SM90 may pick are bitwise the one plan on the same inputs (interpreted)."""
    x = rand(70, 96, seed=7, dtype=torch.bfloat16)
    w = rand(80, 96, seed=8, dtype=torch.bfloat16)
    base = matmul_triton(x, w, plan=MATMUL_PLAN)
    for _, plan in SM90_MATMUL_PLANS:
        assert torch.equal(matmul_triton(x, w, plan=plan), base), plan


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("persistent", [False, True])
def test_bulk_copy_tiles_give_the_pointer_tiles_bits(dtype, bias, persistent):
    """A plan with "tma" (descriptors moving the tiles, zero-filled past the edges), with
    or without a persistent grid (the interpreter's 3 "SMs" walk 6 tiles: 2 each), is the
    same tile's bits, rows invariant to the batch; edges in every dimension. (Float32
    keeps pointer loads: its FMA dot spills with bulk copies on sm_90.)"""
    from kvloom.kernels.batch_invariant_triton import _plan

    m, n, k = 70, 72, 80  # partial tiles in M, N and K: 2 x 2 tiles, 2 x 1 at M <= 64
    x = rand(m, k, seed=11, dtype=dtype)
    w = rand(n, k, seed=12, dtype=dtype, scale=0.2)
    b = rand(n, seed=13, dtype=dtype) if bias else None
    plan = _plan(64, 64, 64, 4, 3, tma=True, persistent=persistent)
    assert plan == {**MATMUL_PLAN, "tma": True, **({"persistent": True} if persistent else {})}
    base = matmul_triton(x, w, b, plan=MATMUL_PLAN)
    out = _assert_rows_invariant(lambda t: matmul_triton(t, w, b, plan=plan), x, (1, 2, 5, 64, 65))
    assert torch.equal(out.view(torch.int16), base.view(torch.int16))
    wide = rand(n * 3, k, seed=16, dtype=dtype, scale=0.2)  # 2 x 4 tiles: 3 programs walk 8
    out = matmul_triton(x, wide, plan=plan)
    assert torch.equal(out.view(torch.int16), matmul_triton(x, wide).view(torch.int16))


def test_bulk_copy_plan_falls_back_to_pointers_where_descriptors_cannot_describe():
    """A row stride that is not a multiple of 16 bytes (here 50 bf16 values) takes the
    pointer kernel: same bits, no error."""
    from kvloom.kernels import batch_invariant_triton as bit

    x = rand(9, 50, seed=14, dtype=torch.bfloat16)[:, :32]
    w = rand(24, 32, seed=15, dtype=torch.bfloat16)
    assert not bit._tma_ready(x) and bit._tma_ready(w)
    tma = {**MATMUL_PLAN, "tma": True}
    assert torch.equal(matmul_triton(x, w, plan=tma), matmul_triton(x, w, plan=MATMUL_PLAN))


def test_matmul_reads_a_strided_input():
    x = rand(9, 48, seed=4)[:, :32]  # last dim contiguous, row stride 48
    w = rand(20, 32, seed=5)
    torch.testing.assert_close(matmul_triton(x, w), linear_ref(x, w), atol=1e-5, rtol=1e-5)


def _conv_case(seed, dtype, tokens=11, channels=70, width=4):
    x = rand(tokens, channels, seed=seed, dtype=dtype)
    weight = rand(channels, width, seed=seed + 1, dtype=dtype, scale=0.5)
    bias = rand(channels, seed=seed + 2, dtype=dtype)
    return x, weight, bias


def _run_chunks(fn, total, cuts, pool, make_args):
    """Runs one sequence of `total` tokens through fn as the chunks `cuts` split it into
    (slot 1 of `pool`, the first chunk fresh), returning the concatenated output."""
    outs, bounds = [], [0, *cuts, total]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        cu = torch.tensor([0, b - a], dtype=torch.int32, device=DEVICE)
        slots = torch.tensor([1], dtype=torch.int32, device=DEVICE)
        has = torch.tensor([i > 0], device=DEVICE)
        outs.append(fn(*make_args(a, b), pool, cu, slots, has))
    return torch.cat(outs)


@pytest.mark.parametrize("token_parallel", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_serial_conv_is_chunking_and_batch_invariant(dtype, token_parallel):
    x, weight, bias = _conv_case(10, dtype)
    channels, width = x.shape[1], weight.shape[1]

    def conv(xs, pool, cu, slots, has):
        return serial_causal_conv1d_triton(
            xs, weight, bias, pool, cu, slots, has, "silu", token_parallel=token_parallel
        )

    def fresh_pool():
        return torch.full((3, channels, width - 1), float("nan"), device=DEVICE)

    runs = {}
    for cuts in ((), (5,), (1, 2, 3), tuple(range(1, 11))):  # one prefill ... all decode
        pool = fresh_pool()
        runs[cuts] = (_run_chunks(conv, 11, cuts, pool, lambda a, b: (x[a:b],)), pool[1])
    first_out, first_state = runs[()]
    for cuts, (out, state) in runs.items():
        assert torch.equal(out, first_out), f"chunks {cuts} change the conv output"
        assert torch.equal(state, first_state), f"chunks {cuts} change the conv state"
    # Inside a batch with another sequence (and a padding row), the same bits.
    other, _, _ = _conv_case(20, dtype, tokens=6)
    pool = fresh_pool()
    pool[2] = rand(channels, width - 1, seed=30)
    batch = torch.cat([other, x])
    cu = torch.tensor([0, 6, 17, 17], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([2, 1, -1], dtype=torch.int32, device=DEVICE)
    has = torch.tensor([True, False, False], device=DEVICE)
    out = conv(batch, pool, cu, slots, has)
    assert torch.equal(out[6:], first_out) and torch.equal(pool[1], first_state)
    # The reference (float32 einsum-free sums) within rounding.
    ref_pool = fresh_pool()
    pool[2] = ref_pool[2] = rand(channels, width - 1, seed=30)
    ref = serial_causal_conv1d_ref(batch, weight, bias, ref_pool, cu, slots.long(), has, "silu")
    tol = 2e-2 if dtype in HALF else 1e-5
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(pool[1], ref_pool[1], atol=tol, rtol=tol)


@pytest.mark.parametrize("block_t", [1, 3, 16])
def test_token_parallel_conv_matches_the_serial_loop(block_t):
    """Programs over blocks of packed tokens (the default mode's mixed steps) give the
    serial loop's outputs and states bit for bit, across row boundaries inside a block:
    a long fresh row, rows continuing a state with 1 and 2 tokens (their new state keeps
    old taps), an empty row, a padding row and padding tokens after the last row."""
    x, weight, bias = _conv_case(11, torch.bfloat16, tokens=24)
    channels, width = x.shape[1], weight.shape[1]
    lengths = [13, 1, 0, 2, 3, 4]
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    slots = torch.tensor([1, 2, 3, 4, -1, 5], dtype=torch.int32, device=DEVICE)
    has = torch.tensor([False, True, True, True, True, False], device=DEVICE)
    start = rand(7, channels, width - 1, seed=12)
    runs = []
    for token_parallel in (False, True):
        pool = start.clone()
        out = serial_causal_conv1d_triton(
            x, weight, bias, pool, cu, slots, has, "silu", token_parallel=token_parallel,
            block_t=block_t,
        )  # fmt: skip
        runs.append((out, pool))
    (loop_out, loop_pool), (par_out, par_pool) = runs
    assert int(cu[-1]) == 23 and not bool(par_out[23:].any()), "padding tokens stay zero"
    assert torch.equal(par_out, loop_out)
    assert torch.equal(par_pool, loop_pool)
    assert not torch.equal(loop_pool[4], start[4])  # the 2-token row's state did move
    assert torch.equal(par_pool[[0, 3, 6]], start[[0, 3, 6]])  # untouched slots


def _gdn_case(seed, tokens, hk=2, hv=4, dk=16, dv=24, dtype=torch.float32, kda=False):
    """Gated DeltaNet's inputs (one log-decay per head), or KDA's (one per key channel)."""
    q = rand(tokens, hk, dk, seed=seed, dtype=dtype)
    k = rand(tokens, hk, dk, seed=seed + 1, dtype=dtype)
    v = rand(tokens, hv, dv, seed=seed + 2, dtype=dtype)
    gate_shape = (tokens, hv, dk) if kda else (tokens, hv)
    g = -torch.rand(*gate_shape, generator=torch.Generator().manual_seed(seed + 3)).to(DEVICE)
    beta = torch.rand(tokens, hv, generator=torch.Generator().manual_seed(seed + 4))
    return q, k, v, g, beta.to(dtype).to(DEVICE)


@pytest.mark.parametrize(
    "dtype,state_dtype,kda,deterministic",
    [
        (torch.bfloat16, torch.float32, False, True),
        (torch.bfloat16, torch.bfloat16, False, True),
        (torch.bfloat16, torch.float32, True, True),
        (torch.float32, torch.float32, True, True),
        (torch.bfloat16, torch.float32, True, False),  # the default mode's KDA tiling
    ],
)
def test_serial_delta_rule_is_chunking_and_batch_invariant(dtype, state_dtype, kda, deterministic):
    """Gated DeltaNet's serial recurrence, and KDA's (per-channel decay, as mixed steps of
    Kimi-Linear run it under KVLOOM_KDA_MIXED_STEPS=serial), in the deterministic mode's form
    and (a float32 state: no rounding to differ) the default mode's tiling."""
    tensors = _gdn_case(40, 9, dtype=dtype, kda=kda)
    hv, dk, dv = tensors[2].shape[1], tensors[0].shape[2], tensors[2].shape[2]
    reference = serial_kda_ref if kda else serial_gated_delta_rule_ref

    def rule(q, k, v, g, beta, pool, cu, slots, has):
        return serial_gated_delta_rule_triton(
            q, k, v, g, beta, pool, cu, slots, has, None, True, per_channel_decay=kda,
            round_every_token=deterministic,
        )  # fmt: skip

    def fresh_pool():
        return torch.full((3, hv, dk, dv), float("nan"), dtype=state_dtype, device=DEVICE)

    runs = {}
    for cuts in ((), (4,), (1, 2), tuple(range(1, 9))):
        pool = fresh_pool()
        out = _run_chunks(rule, 9, cuts, pool, lambda a, b: [t[a:b] for t in tensors])
        runs[cuts] = (out, pool[1])
    first_out, first_state = runs[()]
    for cuts, (out, state) in runs.items():
        assert torch.equal(out, first_out), f"chunks {cuts} change the recurrence output"
        assert torch.equal(state, first_state), f"chunks {cuts} change the state"
    other = _gdn_case(50, 5, dtype=dtype, kda=kda)
    batch = [torch.cat([a, b]) for a, b in zip(other, tensors)]
    pool = fresh_pool()
    pool[2] = rand(hv, dk, dv, seed=60, dtype=state_dtype, scale=0.1)
    ref_pool = pool.clone()
    cu = torch.tensor([0, 5, 14, 14], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([2, 1, -1], dtype=torch.int32, device=DEVICE)
    has = torch.tensor([True, False, False], device=DEVICE)
    out = rule(*batch, pool, cu, slots, has)
    assert torch.equal(out[5:], first_out) and torch.equal(pool[1], first_state)
    ref = reference(*batch, ref_pool, cu, slots.long(), has, None, True)
    tol = 3e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(pool[1:].float(), ref_pool[1:].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("kda", [False, True])
def test_serial_delta_rule_rounds_a_narrow_state_once_outside_the_deterministic_mode(kda):
    """round_every_token=False (the default mode's mixed steps): a bf16 pool's rows keep
    float32 states through their tokens, so the outputs are a float32 pool's (same mode)
    bit for bit and each stored state is the float32 one rounded once; rounding after every
    token (the deterministic mode) gives other bits. The reference does the same."""
    tensors = _gdn_case(40, 9, dtype=torch.bfloat16, kda=kda)
    other = _gdn_case(50, 5, dtype=torch.bfloat16, kda=kda)
    batch = [torch.cat([a, b]) for a, b in zip(other, tensors)]
    hv, dk, dv = tensors[2].shape[1], tensors[0].shape[2], tensors[2].shape[2]
    start = rand(hv, dk, dv, seed=60, dtype=torch.bfloat16, scale=0.1)
    cu = torch.tensor([0, 5, 14, 14], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([2, 1, -1], dtype=torch.int32, device=DEVICE)
    has = torch.tensor([True, False, False], device=DEVICE)

    def run(state_dtype, every, reference=False):
        pool = torch.full((3, hv, dk, dv), float("nan"), dtype=state_dtype, device=DEVICE)
        pool[2] = start.to(state_dtype)
        if reference:
            rule = serial_kda_ref if kda else serial_gated_delta_rule_ref
            out = rule(*batch, pool, cu, slots.long(), has, None, True, round_every_token=every)
        else:
            out = serial_gated_delta_rule_triton(
                *batch, pool, cu, slots, has, None, True, per_channel_decay=kda,
                round_every_token=every,
            )  # fmt: skip
        return out, pool[1:]

    wide_out, wide_states = run(torch.float32, False)  # the same mode's tiling
    once_out, once_states = run(torch.bfloat16, False)
    assert torch.equal(once_out, wide_out)
    assert torch.equal(once_states, wide_states.to(torch.bfloat16))
    every_out, every_states = run(torch.bfloat16, True)
    assert not torch.equal(every_out, once_out) and not torch.equal(every_states, once_states)
    ref_wide_out, ref_wide_states = run(torch.float32, True, reference=True)
    ref_out, ref_states = run(torch.bfloat16, False, reference=True)
    assert torch.equal(ref_out, ref_wide_out)
    assert torch.equal(ref_states, ref_wide_states.to(torch.bfloat16))
    torch.testing.assert_close(once_out.float(), ref_out.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(once_states.float(), ref_states.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize(
    "deterministic, want",
    [
        (False, (32, SERIAL_WARPS)),  # the default mode: fewer warps, a shorter token step
        (True, (32, 4)),  # the deterministic mode: the decode kernel's tiling
    ],
)
def test_serial_recurrence_tiling_by_mode(deterministic, want):
    assert SERIAL_WARPS != 4  # else the two modes' rows above test nothing apart
    assert serial_recurrence_tiling(128, 128, deterministic) == want
    assert serial_recurrence_tiling(16, 24, deterministic)[0] == 32  # a whole small head


def test_serial_recurrence_takes_the_modes_tiling(monkeypatch):
    """The launch asks the rule with the deterministic flag it was given (round_every_token,
    which the layers set to batch_invariant()), unless a tiling is passed."""
    import kvloom.kernels.batch_invariant_triton as bit

    asked = []

    def rule(head_k, head_v, deterministic):
        asked.append(deterministic)
        return 8, 1

    monkeypatch.setattr(bit, "serial_recurrence_tiling", rule)
    q, k, v, g, beta = _gdn_case(40, 3, kda=True)
    hv, dk, dv = v.shape[1], q.shape[2], v.shape[2]
    cu = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([0], dtype=torch.int32, device=DEVICE)
    has = torch.tensor([False], device=DEVICE)
    outs = []
    for every in (False, True):
        pool = torch.zeros(1, hv, dk, dv, device=DEVICE)
        outs.append(
            serial_gated_delta_rule_triton(
                q,
                k,
                v,
                g,
                beta,
                pool,
                cu,
                slots,
                has,
                None,
                True,
                per_channel_decay=True,
                round_every_token=every,
            )  # fmt: skip
        )
    assert asked == [False, True]
    ref = serial_kda_ref(q, k, v, g, beta, torch.zeros(1, hv, dk, dv, device=DEVICE), cu,
                         slots.long(), has, None, True)  # fmt: skip
    for out in outs:  # the rule's narrow 8-column tiles still cover the 24-wide head
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-5, rtol=2e-5)


def test_serial_reference_keeps_a_float64_pool_in_float64():
    """The CPU's float64 runs: without per-token rounding the reference still computes in
    the pool's float64 (no float32 copy), so both settings give the same bits."""
    tensors = _gdn_case(40, 9, dtype=torch.float64)
    hv, dk, dv = tensors[2].shape[1], tensors[0].shape[2], tensors[2].shape[2]
    cu = torch.tensor([0, 9], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([1], dtype=torch.int64, device=DEVICE)
    has = torch.tensor([True], device=DEVICE)
    runs = []
    for every in (True, False):
        pool = torch.zeros((2, hv, dk, dv), dtype=torch.float64, device=DEVICE)
        pool[1] = rand(hv, dk, dv, seed=60, dtype=torch.float64, scale=0.1)
        out = serial_gated_delta_rule_ref(
            *tensors, pool, cu, slots, has, None, True, round_every_token=every
        )
        runs.append((out, pool))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def _paged_cache(ctx, kv_heads, dim, block, seed, dtype):
    blocks = -(-ctx // block)
    cache = torch.full((2, blocks + 2, block, kv_heads, dim), float("nan"), dtype=dtype)
    table = torch.arange(1, blocks + 1, dtype=torch.int32)
    kv = torch.randn(2, ctx, kv_heads, dim, generator=torch.Generator().manual_seed(seed))
    for p in range(ctx):
        cache[:, table[p // block], p % block] = kv[:, p].to(dtype)
    return cache.to(DEVICE), table.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_plan_gives_a_query_the_same_bits_in_prefill_and_decode(dtype):
    """Query token p of a request attends over the cache: computed in one prefill, in a
    prefill chunk after a prefix hit, or as a decode step (alone or beside another row),
    with the mode's one plan it gets the same bits."""
    heads, kv_heads, dim, block, ctx = 4, 2, 16, 4, 40
    cache, table = _paged_cache(ctx, kv_heads, dim, block, 70, dtype)
    q = rand(ctx, heads, dim, seed=71, dtype=dtype)
    plan = attention_plan(heads // kv_heads, dim, dtype)

    def attend(queries, starts, lens, tables):
        qsl = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
        out, _ = paged_attention_triton(
            queries, cache, tables, qsl,
            torch.tensor(lens, dtype=torch.int32, device=DEVICE), dim**-0.5,
            _plan_override=plan,
        )  # fmt: skip
        return out

    tables = table.view(1, -1)
    whole = attend(q, [0, ctx], [ctx], tables)
    chunk = attend(q[24:], [0, ctx - 24], [ctx], tables)  # resumes after a 24-token hit
    assert torch.equal(chunk, whole[24:])
    for p in (0, 17, 31, ctx - 1):  # decode steps, alone and after another row's chunk
        alone = attend(q[p : p + 1], [0, 1], [p + 1], tables)
        assert torch.equal(alone, whole[p : p + 1]), f"decode at position {p}"
        pair = attend(torch.cat([q[:5], q[p : p + 1]]), [0, 5, 6], [5, p + 1], tables.expand(2, -1))
        assert torch.equal(pair[5:], whole[p : p + 1]), f"decode at {p} beside a prefill"
    qsl = torch.tensor([0, ctx], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([ctx], dtype=torch.int32, device=DEVICE)
    ref, _ = paged_attention_ref(q, cache, tables, qsl, lens, dim**-0.5)
    tol = 2e-2 if dtype in HALF else 2e-5
    torch.testing.assert_close(whole.float(), ref.float(), atol=tol, rtol=tol)


@gpu
@needs_cuda
@pytest.mark.parametrize("n,k", [(4096, 4096), (12288, 4096), (4096, 12288), (151936, 4096)])
def test_gpu_matmul_rows_invariant_at_model_widths(n, k):
    """Qwen3-8B widths in bfloat16: rows alone vs in batches of 1..600 rows, bitwise."""
    x = rand(600, k, seed=80, dtype=torch.bfloat16)
    w = rand(n, k, seed=81, dtype=torch.bfloat16, scale=0.02)
    full = matmul_triton(x, w)
    # Row counts on both sides of each SM90 tile boundary (128, 512): plans change there.
    for m in (1, 2, 3, 17, 64, 65, 128, 129, 256, 512, 513, 599):
        assert torch.equal(matmul_triton(x[:m], w), full[:m]), f"batch of {m}"
    for _, plan in SM90_MATMUL_PLANS + ((None, MATMUL_PLAN),):
        assert torch.equal(matmul_triton(x, w, plan=plan), full), f"plan {plan}"
        for loads in ({"tma": True}, {"tma": True, "persistent": True}):
            moved = {**plan, **loads}  # the same tile moved by bulk copies (and persistent)
            assert torch.equal(matmul_triton(x, w, plan=moved), full), f"plan {moved}"
    ref = torch.nn.functional.linear(x.float(), w.float())
    torch.testing.assert_close(full.float(), ref, atol=3e-2, rtol=2e-2)
