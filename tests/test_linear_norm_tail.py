"""The linear-attention decode step's output norm in its own launch where a value head spans
several programs (`linear_norm_tail`, on by default at up to NORM_TAIL_MAX_ROWS rows;
kernels/gated_delta_rule_triton.py): the last of a head's programs to store applies the
norm to the whole head, read back as stored.

Against the launches it replaces (the recurrence with the gates, then the norm launch:
`gated_rms_norm_triton` for Gated DeltaNet, `kda_gated_norm_triton` for KDA), bit for bit
on every real row and the whole state pool; padding rows give zeros, as the one-launch
plan gives them (the norm launch would give 0 * silu(z), NaN for their NaN inputs). No
norm launch may run, and the arrival counters are left at 0.

Without CUDA the kernels run in Triton's CPU interpreter, which runs programs one after
another (so the last to arrive is the last program); the `gpu`-marked tests run the
cross-program order compiled at Qwen3-Next's and Kimi-Linear's 128 x 128 heads, the
production plan (block_v 32: four programs a head), eagerly and in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from kvloom.kernels import arrival_counters
from kvloom.kernels import gated_delta_rule_triton as gdr
from kvloom.kernels.arrival_counters import counters_of
from tests import test_gdn_decode_fusion as gdn_cases
from tests import test_kda_decode_fusion as kda_cases
from tests.kernel_env import gpu, needs_cuda


@pytest.fixture
def norm_tail_on(monkeypatch):
    """The fusion on (the default) at every row count, and the norm launches it replaces
    made to fail if called."""
    monkeypatch.delenv("KVLOOM_UNFUSED", raising=False)
    monkeypatch.setattr(gdr, "NORM_TAIL_MAX_ROWS", 1 << 30)

    def no_norm_launch(*args, **kwargs):
        raise AssertionError("the norm ran as its own launch")

    monkeypatch.setattr(gdr, "gated_rms_norm_triton", no_norm_launch)
    monkeypatch.setattr(gdr, "kda_gated_norm_triton", no_norm_launch)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])


def assert_counters_zero():
    for counters in counters_of("linear_norm_tail"):
        assert int(counters.abs().sum()) == 0, "an arrival counter was left set"


def check_gdn(step, block_v, monkeypatch):
    """The tail against the separate launches (the fusion off for the want)."""
    pool_got, pool_want = step.pool.clone(), step.pool.clone()
    got = gdn_cases.fused(step, pool_got, block_v)
    with monkeypatch.context() as patch:
        patch.setenv("KVLOOM_UNFUSED", "linear_norm_tail")
        want = gdn_cases.separate(step, pool_want, block_v)
    real = step.indices >= 0
    assert not torch.isnan(got[real]).any(), "NaN in a real row"
    assert torch.equal(bits(got[real]), bits(want[real])), "output differs from the launches"
    assert torch.equal(got[~real], torch.zeros_like(got[~real])), "padding rows not zero"
    assert torch.equal(bits(pool_got), bits(pool_want)), "state differs"
    assert_counters_zero()


@pytest.mark.parametrize("block_v", [4, 8])
@pytest.mark.parametrize(
    "name", ["bf16 GQA2 fused-proj", "fp16 qkvz-z bf16-state", "fp32 qwen3.5-ba"]
)
def test_gdn_tail_equals_recurrence_then_norm_bitwise(norm_tail_on, monkeypatch, name, block_v):
    """Dv = 16 over four or two programs a head, padding rows among the real ones."""
    rows, hk, hv, dk, dv, dtype, options = gdn_cases.CASES[name]
    step = gdn_cases.make_step(
        rows, hk, hv, dk, dv, dtype, seed=gdn_cases.seed_of("tail", name), **options
    )
    check_gdn(step, block_v, monkeypatch)


def test_gdn_default_plan_past_the_tile_budget(norm_tail_on, monkeypatch):
    """With no override, a 64 x 128 head takes narrow tiles (two programs a head)."""
    assert not gdr.fuses_norm(64, 128)
    step = gdn_cases.make_step(
        3, 1, 2, 64, 128, torch.bfloat16, seed=gdn_cases.seed_of("tail-default"), num_pad=1
    )
    check_gdn(step, None, monkeypatch)


@pytest.mark.parametrize("num_pad", [0, 1])
def test_kda_tail_equals_recurrence_then_norm_bitwise(norm_tail_on, monkeypatch, num_pad):
    """KDA's sigmoid-gated norm, Dv = 32 over four programs a head, bf16 state too."""
    for state_dtype in (torch.float32, torch.bfloat16):
        args, used = kda_cases.make_step(
            3, 2, 32, torch.bfloat16, seed=21 + num_pad, num_pad=num_pad, state_dtype=state_dtype
        )
        got_args, want_args = kda_cases.clone_args(args), kda_cases.clone_args(args)
        got = gdr.kda_decode_triton(**got_args, use_qk_l2norm=True, _block_v_override=8)
        with monkeypatch.context() as patch:
            patch.setenv("KVLOOM_UNFUSED", "linear_norm_tail")
            want = kda_cases.separate(want_args, block_v=8)
        real = len(used)
        assert torch.equal(bits(got[:real]), bits(want[:real])), "output differs"
        assert torch.equal(got[real:], torch.zeros_like(got[real:])), "padding rows not zero"
        assert torch.equal(got_args["state"].view(torch.int8), want_args["state"].view(torch.int8))
        assert_counters_zero()


def test_unfused_keeps_the_norm_launch(monkeypatch):
    """With KVLOOM_UNFUSED naming it, narrow tiles keep the separate norm launch."""
    monkeypatch.setenv("KVLOOM_UNFUSED", "linear_norm_tail")
    calls = []
    norm = gdr.gated_rms_norm_triton
    monkeypatch.setattr(
        gdr, "gated_rms_norm_triton", lambda *a, **k: (calls.append(1), norm(*a, **k))[1]
    )
    step = gdn_cases.make_step(2, 1, 2, 16, 16, torch.bfloat16, seed=31)
    gdn_cases.fused(step, step.pool.clone(), 8)
    assert calls == [1]


def test_steps_past_the_row_bound_keep_the_norm_launch_unless_forced(monkeypatch):
    """Past NORM_TAIL_MAX_ROWS rows the step runs the separate norm launch (the tail lost
    there on an H100), at or under it the tail; `norm_tail=` forces either way; every
    choice the same bits on the real rows."""
    monkeypatch.delenv("KVLOOM_UNFUSED", raising=False)
    monkeypatch.setattr(gdr, "NORM_TAIL_MAX_ROWS", 3)
    calls = []
    norm = gdr.gated_rms_norm_triton
    monkeypatch.setattr(
        gdr, "gated_rms_norm_triton", lambda *a, **k: (calls.append(1), norm(*a, **k))[1]
    )
    assert gdr.uses_norm_tail(3) and not gdr.uses_norm_tail(4)
    for rows, norm_launches in ((3, []), (4, [1])):
        step = gdn_cases.make_step(rows, 1, 2, 16, 16, torch.bfloat16, seed=40 + rows)
        real = step.indices >= 0
        outs = {}
        for forced in (None, True, False):
            calls.clear()
            outs[forced] = gdr.gdn_decode_triton(
                step.q, step.k, step.v, step.ba, step.A_log, step.dt_bias, step.ba_group,
                step.pool.clone(), step.indices, step.z, step.weight, gdn_cases.EPS,
                use_qk_l2norm=True, norm_tail=forced, _block_v_override=8,
            )  # fmt: skip
            want_calls = norm_launches if forced is None else ([] if forced else [1])
            assert calls == want_calls, (rows, forced)
        for forced in (True, False):
            assert torch.equal(bits(outs[forced][real]), bits(outs[None][real])), (rows, forced)
    assert_counters_zero()


def test_counters_grow_and_keep_the_old_buffer(monkeypatch):
    """A launch of more rows than the counters hold gets a bigger buffer; the old one stays
    alive (a captured CUDA graph may hold its pointer)."""
    monkeypatch.setattr(arrival_counters, "_BUFFERS", {})
    monkeypatch.setattr(arrival_counters, "_RETIRED", [])
    device = torch.device("cpu")
    small = gdr.norm_tail_counters(device, 3, 4)
    assert small.shape == (gdr.NORM_TAIL_MIN_ROWS, 4) and int(small.sum()) == 0
    assert gdr.norm_tail_counters(device, 7, 4) is small
    big = gdr.norm_tail_counters(device, gdr.NORM_TAIL_MIN_ROWS + 1, 4)
    assert big.shape[0] == gdr.NORM_TAIL_MIN_ROWS + 1
    retired, (live,) = arrival_counters._RETIRED, counters_of("linear_norm_tail")
    assert len(retired) == 1 and retired[0] is small and live is big


# ---------------------------------------------------------------- on the GPU


@gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_gpu_qwen3_next_and_kimi_heads(norm_tail_on, monkeypatch, rows):
    """Compiled, the production plan at 128 x 128 heads (four programs a head): Gated
    DeltaNet at Qwen3-Next's 16 key / 32 value heads, KDA at Kimi-Linear's 32 heads."""
    case = (rows, 16, 32, 128, 128, torch.bfloat16)
    step = gdn_cases.make_step(
        *case, seed=gdn_cases.seed_of("gpu tail", *case), num_pad=rows // 4, num_slots=2 * rows + 3
    )
    assert not gdr.fuses_norm(128, 128)
    check_gdn(step, None, monkeypatch)
    args, used = kda_cases.make_step(rows, 32, 128, torch.bfloat16, seed=rows, num_pad=rows // 4)
    got_args, want_args = kda_cases.clone_args(args), kda_cases.clone_args(args)
    got = gdr.kda_decode_triton(**got_args, use_qk_l2norm=True)
    with monkeypatch.context() as patch:
        patch.setenv("KVLOOM_UNFUSED", "linear_norm_tail")
        want = kda_cases.separate(want_args)
    real = len(used)
    assert torch.equal(bits(got[:real]), bits(want[:real]))
    assert torch.equal(got_args["state"].view(torch.int8), want_args["state"].view(torch.int8))
    assert_counters_zero()


@gpu
@needs_cuda
def test_gpu_graph_replays_and_back_to_back_launches(norm_tail_on, monkeypatch):
    """Twenty launches queued back to back on one pool, then a CUDA graph of them replayed
    on fresh inputs: equal to the separate launches, the counters 0 after."""
    case = (8, 16, 32, 128, 128, torch.bfloat16)
    step = gdn_cases.make_step(*case, seed=gdn_cases.seed_of("tail graph", *case), num_pad=2)
    pool, want_pool = step.pool.clone(), step.pool.clone()
    outs = [gdn_cases.fused(step, pool) for _ in range(20)]
    with monkeypatch.context() as patch:
        patch.setenv("KVLOOM_UNFUSED", "linear_norm_tail")
        wants = [gdn_cases.separate(step, want_pool) for _ in range(20)]
    real = step.indices >= 0
    for got, want in zip(outs, wants):
        assert torch.equal(bits(got[real]), bits(want[real]))
    assert torch.equal(bits(pool), bits(want_pool))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gdn_cases.fused(step, pool)
    fresh = gdn_cases.make_step(*case, seed=gdn_cases.seed_of("tail fresh", *case), num_pad=2)
    for name in ("q", "k", "v", "ba", "z", "A_log", "dt_bias", "weight", "indices"):
        getattr(step, name).copy_(getattr(fresh, name))
    pool.copy_(fresh.pool)
    graph.replay()
    torch.cuda.synchronize()
    want_pool = fresh.pool.clone()
    with monkeypatch.context() as patch:
        patch.setenv("KVLOOM_UNFUSED", "linear_norm_tail")
        want = gdn_cases.separate(fresh, want_pool)
    real = fresh.indices >= 0
    assert torch.equal(bits(captured[real]), bits(want[real]))
    assert torch.equal(bits(pool), bits(want_pool))
    assert_counters_zero()
