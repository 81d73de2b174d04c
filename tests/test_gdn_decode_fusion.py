"""Gated DeltaNet's fused decode step (`gdn_decode_triton`, kernels/gated_delta_rule_triton.py)
against the three launches it replaces: `gdn_gates_triton`, then
`recurrent_gated_delta_rule_triton` with those g and beta, then `gated_rms_norm_triton`.
Bit for bit: the output of every real row and the whole state pool (each separate kernel
is tested against its torch reference in its own file).

Inputs are cut from one projection output as the layer cuts them: q, k, v, z and ba are
strided column views; z is [N, Hv, Dv] (fused in_proj) or [N, Hk, r, Dv] (the released
in_proj_qkvz); ba holds b then a per group of `ba_group` value heads (Qwen3-Next: r, per
key head; Qwen3.5: all heads). Padding rows (negative slot index) carry NaN inputs and
must give exact zeros (the separate norm gives 0 * silu(z) there: not compared); slots no
row names hold NaN and must keep their bits.

Without CUDA the kernels run in Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1) at small shapes; with CUDA the same tests run compiled, and the
`gpu`-marked ones add Qwen3-Next's shape (TP 1 and 2), a CUDA-graph replay and a count of
the launches.
"""

from __future__ import annotations

import types
import zlib
from dataclasses import dataclass

import pytest
import torch

from kvloom.kernels.gated_delta_rule_triton import (
    fuses_norm,
    gdn_decode_triton,
    recurrent_gated_delta_rule_triton,
    uses_norm_tail,
)
from kvloom.kernels.gated_rms_norm_triton import gated_rms_norm_triton
from kvloom.kernels.gdn_gates_triton import gdn_gates_triton
from kvloom.workers.layers import gated_deltanet as gdn_module
from kvloom.workers.layers.gated_deltanet import GatedDeltaNet
from tests.kernel_env import DEVICE, gpu, needs_cuda

EPS = 1e-6


def seed_of(*case) -> int:
    return zlib.crc32(repr(case).encode())


@dataclass
class Step:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    ba: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    ba_group: int
    z: torch.Tensor
    weight: torch.Tensor
    pool: torch.Tensor
    indices: torch.Tensor
    used: list[int]


def make_step(
    rows, hk, hv, dk, dv, dtype, *, seed, num_pad=0, ba_group=None, z_4d=False,
    state_dtype=torch.float32, weight_dtype=None, num_slots=None,
):  # fmt: skip
    """One decode step's inputs, fresh random values (made on the CPU, moved to DEVICE)."""
    gen = torch.Generator().manual_seed(seed)
    r = hv // hk
    ba_group = ba_group or r

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    key, value = hk * dk, hv * dv
    if z_4d:  # in_proj_qkvz's per-key-head [q, k, v, z], as the unfused layer holds it
        qkvz = randn(rows, hk, 2 * dk + 2 * r * dv).to(DEVICE, dtype)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        v, z = v.reshape(rows, hv, dv), z.view(rows, hk, r, dv)
        ba = randn(rows, 2 * hv).to(DEVICE, dtype)
    else:  # one fused in_proj output [q | k | v | z | b,a]
        proj = randn(rows, 2 * key + 2 * value + 2 * hv).to(DEVICE, dtype)
        q, k, v, z, ba = proj.split([key, key, value, value, 2 * hv], dim=-1)
        q, k = q.view(rows, hk, dk), k.view(rows, hk, dk)
        v, z = v.view(rows, hv, dv), z.view(rows, hv, dv)
    A_log = randn(hv, scale=0.5).to(DEVICE, dtype)
    dt_bias = randn(hv).to(DEVICE, dtype)
    weight = (randn(dv, scale=0.2) + 1).to(DEVICE, weight_dtype or dtype)

    num_slots = num_slots or rows + 3
    slots = torch.randperm(num_slots, generator=gen)[:rows].tolist()
    for i, row in enumerate(torch.randperm(rows, generator=gen)[:num_pad].tolist()):
        slots[row] = -1 - 2 * i
    used = [s for s in slots if s >= 0]
    indices = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    pool = randn(num_slots, hv, dk, dv, scale=0.5).to(DEVICE, state_dtype)
    pool[[s for s in range(num_slots) if s not in used]] = float("nan")
    pad = indices < 0
    for t in (q, k, v, z, ba):
        t[pad] = float("nan")  # views: poisons the projection rows they read
    return Step(q, k, v, ba, A_log, dt_bias, ba_group, z, weight, pool, indices, used)


def fused(step: Step, pool: torch.Tensor, block_v=None) -> torch.Tensor:
    return gdn_decode_triton(
        step.q, step.k, step.v, step.ba, step.A_log, step.dt_bias, step.ba_group, pool,
        step.indices, step.z, step.weight, EPS, use_qk_l2norm=True, _block_v_override=block_v,
    )  # fmt: skip


def separate(step: Step, pool: torch.Tensor, block_v=None) -> torch.Tensor:
    g, beta = gdn_gates_triton(step.ba, step.A_log, step.dt_bias, step.ba_group)
    core = recurrent_gated_delta_rule_triton(
        step.q, step.k, step.v, g, beta, pool, step.indices, use_qk_l2norm=True,
        _block_v_override=block_v,
    )  # fmt: skip
    return gated_rms_norm_triton(core, step.z, step.weight, EPS)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])


def check_bitwise(name, step: Step, block_v=None) -> torch.Tensor:
    """Fused against separate on clones of one pool; returns the fused output."""
    before = step.pool.clone()
    pool_fused, pool_separate = step.pool.clone(), step.pool.clone()
    got = fused(step, pool_fused, block_v)
    want = separate(step, pool_separate, block_v)
    real = step.indices >= 0
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    head_k, head_v = step.q.shape[2], step.v.shape[2]
    # The norm in the step's launch: one program a head, or the head's last (the norm
    # tail, on unless KVLOOM_UNFUSED names linear_norm_tail).
    whole_head = block_v >= head_v if block_v else fuses_norm(head_k, head_v)
    if whole_head or uses_norm_tail(step.q.shape[0]):  # padding rows zero
        assert torch.equal(got[~real], torch.zeros_like(got[~real])), f"{name}: padding row"
    else:  # two: the separate norm's, of the recurrence's zeros
        real = torch.ones_like(real)
    assert not torch.isnan(got[step.indices >= 0]).any(), f"{name}: NaN in a real row"
    differing = (bits(got[real]) != bits(want[real])).sum().item()
    assert differing == 0, f"{name}: {differing} output elements differ from the 3 launches"
    assert torch.equal(bits(pool_fused), bits(pool_separate)), f"{name}: state differs"
    unused = [s for s in range(step.pool.shape[0]) if s not in step.used]
    assert torch.equal(bits(pool_fused[unused]), bits(before[unused])), f"{name}: slot written"
    assert not torch.equal(pool_fused[step.used], before[step.used]), f"{name}: no update"
    return got


# ------------------------------------------------------------------ interpreted or compiled

CASES = {
    # name: (rows, hk, hv, dk, dv, dtype, options)
    "bf16 GQA2 fused-proj": (5, 2, 4, 16, 16, torch.bfloat16, dict(num_pad=2)),
    "fp16 qkvz-z bf16-state": (
        4, 2, 4, 16, 16, torch.float16,
        dict(num_pad=1, z_4d=True, state_dtype=torch.bfloat16),
    ),
    "fp32 qwen3.5-ba": (3, 2, 4, 16, 16, torch.float32, dict(ba_group=4, num_pad=1)),
    "bf16 fp32-weight": (3, 1, 2, 16, 16, torch.bfloat16, dict(weight_dtype=torch.float32)),
    "bf16 GQA1 odd-dims": (4, 2, 2, 12, 12, torch.bfloat16, dict(num_pad=1)),
    "bf16 bf16-state": (3, 2, 4, 16, 8, torch.bfloat16, dict(state_dtype=torch.bfloat16)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_one_launch_equals_the_three(name):
    rows, hk, hv, dk, dv, dtype, options = CASES[name]
    assert fuses_norm(dk, dv)  # this plan is the one-launch path
    step = make_step(rows, hk, hv, dk, dv, dtype, seed=seed_of(name), **options)
    check_bitwise(name, step)


def test_narrow_tiles_keep_the_norm_separate_and_equal():
    """A program holding a part of a value head (block_v < Dv) cannot normalise it: two
    launches (gates fused into the recurrence, then the norm), still bit for bit."""
    step = make_step(4, 2, 4, 16, 16, torch.bfloat16, seed=seed_of("narrow"), num_pad=1)
    check_bitwise("narrow", step, block_v=8)


def test_the_default_plan_past_the_tile_budget_is_two_launches():
    """With no override, a head wider than the tile budget (64 x 128 here; Qwen3-Next's
    128 x 128 on the GPU) takes narrow tiles: padding rows carry the separate norm's
    values, which the check must expect rather than one launch's zeros."""
    assert not fuses_norm(64, 128)
    step = make_step(3, 1, 2, 64, 128, torch.bfloat16, seed=seed_of("default-narrow"), num_pad=1)
    check_bitwise("default narrow", step)


def test_rows_do_not_depend_on_the_batch():
    """A row's output and state are the same alone as among others (invariant 7)."""
    step = make_step(4, 2, 4, 16, 16, torch.bfloat16, seed=seed_of("batch"))
    pool_all, pool_one = step.pool.clone(), step.pool.clone()
    together = fused(step, pool_all)
    row = 2
    alone_step = Step(
        step.q[row : row + 1], step.k[row : row + 1], step.v[row : row + 1],
        step.ba[row : row + 1], step.A_log, step.dt_bias, step.ba_group, step.z[row : row + 1],
        step.weight, pool_one, step.indices[row : row + 1], step.used,
    )  # fmt: skip
    alone = fused(alone_step, pool_one)
    slot = step.indices[row].item()
    assert torch.equal(bits(alone), bits(together[row : row + 1]))
    assert torch.equal(bits(pool_one[slot]), bits(pool_all[slot]))


def test_bad_arguments_name_the_field():
    step = make_step(2, 2, 4, 16, 16, torch.bfloat16, seed=seed_of("bad"))
    with pytest.raises(ValueError, match="ba"):
        gdn_decode_triton(
            step.q, step.k, step.v, step.ba[:, :6], step.A_log, step.dt_bias, 2, step.pool,
            step.indices, step.z, step.weight, EPS,
        )  # fmt: skip
    with pytest.raises(ValueError, match="gate"):
        gdn_decode_triton(
            step.q, step.k, step.v, step.ba, step.A_log, step.dt_bias, 2, step.pool,
            step.indices, step.z[:, :2], step.weight, EPS,
        )  # fmt: skip
    with pytest.raises(ValueError, match="weight"):
        gdn_decode_triton(
            step.q, step.k, step.v, step.ba, step.A_log, step.dt_bias, 2, step.pool,
            step.indices, step.z, step.weight[:8], EPS,
        )  # fmt: skip


LAYER_CONFIG = dict(
    hidden_size=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    hidden_act="silu",
    rms_norm_eps=1e-6,
)


def random_layer(fuse_projections: bool, seed: int) -> GatedDeltaNet:
    """A float32 GatedDeltaNet with random weights and a random state pool of 6 pages."""
    gen = torch.Generator().manual_seed(seed)
    layer = GatedDeltaNet(LAYER_CONFIG, 0, None, torch.float32, fuse_projections)
    for name, param in layer.named_parameters():
        scale = 0.2 if "norm" in name else 0.3
        param.data = (torch.randn(param.shape, generator=gen) * scale).to(DEVICE)
        if "norm" in name:
            param.data += 1
    channels, width = layer.conv_channels, layer.conv_width
    layer.conv_state = torch.randn(6, channels, width - 1, generator=gen).to(DEVICE)
    shape = (6, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)
    layer.recurrent_state = (torch.randn(shape, generator=gen) * 0.3).to(DEVICE)
    return layer


@pytest.mark.parametrize("fuse_projections", [True, False])
def test_layer_decode_step_through_the_kernel(fuse_projections, monkeypatch):
    """The layer's decode-only step with the fused kernel (interpreted on CPU tensors)
    against the same step through the torch references: the layer hands the kernel its
    views (z, ba and its group, in the fused and the released projection layouts), A_log,
    dt_bias and the norm's weight and eps as the references read them. float32: the
    kernel's sums run in another order than torch's (~1e-5 relative, as in
    tests/test_linear_decode_triton.py), carried through the norm and out_proj."""
    layer = random_layer(fuse_projections, seed=seed_of("layer", fuse_projections))
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, LAYER_CONFIG["hidden_size"], generator=gen).to(DEVICE)
    slots = torch.tensor([4, -1, 1], dtype=torch.int64, device=DEVICE)
    group = types.SimpleNamespace(state_indices=slots)
    batch = types.SimpleNamespace(decode_only=True, group_for=lambda index: group)
    pools = layer.conv_state.clone(), layer.recurrent_state.clone()
    with torch.inference_mode():
        want = layer(hidden, batch)
    want_state = layer.recurrent_state.clone()
    layer.conv_state, layer.recurrent_state = pools

    def fused_step(q, k, v, ba, A_log, dt_bias, ba_group, state, indices, z, weight, eps):
        calls.append(ba_group)
        return gdn_decode_triton(
            q, k, v, ba, A_log, dt_bias, ba_group, state, indices.to(torch.int32), z, weight,
            eps, use_qk_l2norm=True,
        )  # fmt: skip

    calls: list[int] = []
    monkeypatch.setattr(gdn_module, "gdn_decode_step", fused_step)
    with torch.inference_mode():
        got = layer(hidden, batch)
    assert calls == [layer.ba_group]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(layer.recurrent_state, want_state, rtol=1e-4, atol=1e-5)
    assert torch.equal(layer.recurrent_state[[0, 2, 3, 5]], pools[1][[0, 2, 3, 5]])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the real run is the GPU benchmark itself")
def test_benchmark_tiny_run_with_a_bf16_state(tmp_path):
    """benchmarks/gdn_decode_fusion.py --tiny --state-dtype bfloat16 --rows 2 (CPU
    interpreter): the pools are narrowed, the rows asked for are the rows run, and every
    variant gives its three launches' bits."""
    from benchmarks import gdn_decode_fusion as bench

    out = tmp_path / "gdn.json"
    result = bench.main(["--tiny", "--state-dtype", "bfloat16", "--rows", "2", "--out", str(out)])
    rows = result["rows"]
    assert out.exists() and len(rows) == len(bench.TINY_SHAPES) * len(bench.TINY_VARIANTS)
    assert {(r["rows"], r["state_dtype"]) for r in rows} == {(2, "bfloat16")}
    assert all(r["same_bits_as_three_launches"] for r in rows), rows


@pytest.mark.parametrize("flag, forced", [("rule", None), ("on", True), ("off", False)])
def test_benchmark_norm_tail_flag_reaches_the_fused_steps(flag, forced, monkeypatch):
    """--norm-tail forces the fused steps' norm tail (or leaves `uses_norm_tail`'s rule),
    recorded in each row."""
    from benchmarks import gdn_decode_fusion as bench

    seen = []

    def recording(*args, norm_tail=None, **kwargs):
        seen.append(norm_tail)
        return gdn_decode_triton(*args, norm_tail=norm_tail, **kwargs)

    monkeypatch.setattr(bench, "gdn_decode_triton", recording)
    result = bench.main(["--tiny", "--rows", "1", "--norm-tail", flag])
    assert seen and set(seen) == {forced}
    assert {r["norm_tail"] for r in result["rows"]} == {flag}


# ------------------------------------------------------------------------------------- gpu


@gpu
@needs_cuda
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 8, 33])
@pytest.mark.parametrize("hk", [16, 8])  # Qwen3-Next at TP 1 and 2
def test_gpu_qwen3_next_shape(hk, rows, state_dtype):
    """Compiled: the production plan (narrow tiles, the norm tail at up to 8 rows, else a
    second norm launch) and a whole head per program (one launch), each bit for bit its
    separate launches."""
    case = (rows, hk, 2 * hk, 128, 128, torch.bfloat16)
    options = dict(num_pad=rows // 4, state_dtype=state_dtype, num_slots=2 * rows + 3)
    step = make_step(*case, seed=seed_of("gpu", *case, state_dtype), **options)
    assert not fuses_norm(128, 128)
    check_bitwise(f"gpu {case}", step)
    check_bitwise(f"gpu {case} whole head", step, block_v=128)


@gpu
@needs_cuda
@pytest.mark.parametrize("block_v", [None, 128])  # the production plan; a whole head
def test_gpu_cuda_graph_replay_and_launches(block_v):
    case = (8, 16, 32, 128, 128, torch.bfloat16)
    step = make_step(*case, seed=seed_of("graph", *case), num_pad=2)
    pool = step.pool.clone()
    fused(step, pool.clone(), block_v)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = fused(step, pool, block_v)
    fresh = make_step(*case, seed=seed_of("graph fresh", *case), num_pad=2)
    for name in ("q", "k", "v", "ba", "z", "A_log", "dt_bias", "weight", "indices"):
        getattr(step, name).copy_(getattr(fresh, name))
    pool.copy_(fresh.pool)
    graph.replay()
    torch.cuda.synchronize()
    eager_pool = fresh.pool.clone()
    assert torch.equal(bits(graph_out), bits(fused(fresh, eager_pool, block_v)))
    assert torch.equal(bits(pool), bits(eager_pool))

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    spare_pool = fresh.pool.clone()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fused(fresh, spare_pool, block_v)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    names = [n for n in names if not n.startswith(("Memcpy", "Memset"))]
    separate_norm = not block_v and not uses_norm_tail(fresh.q.shape[0])
    kernels = ["_delta_rule_decode_kernel"] + (["_gated_rms_norm_kernel"] if separate_norm else [])
    assert len(names) == len(kernels), names
    assert all(kernel in name for kernel, name in zip(kernels, names)), names
