"""The linear-attention decode kernels (gated delta rule / KDA step, causal conv1d update)
against their pure-torch references, on fresh random inputs.

Without CUDA the kernels run in Triton's CPU interpreter (the root conftest sets
TRITON_INTERPRET=1) at small shapes; with CUDA the same tests run compiled, and the
`gpu` test adds the Qwen3-Next decode shape and a CUDA-graph capture + replay.

Poisoning, as the sanitizer does it: slots no row uses hold NaN and must come back
bitwise unchanged; padding rows (negative slot index) carry NaN inputs and must output
exact zeros. So a kernel that reads an unused slot or a padding row's data fails.

Tolerances. float32: ~1e-5 (only the order of float32 sums differs from torch). bfloat16
activations: the kernels compute in float32 from the same bf16 inputs as the reference,
so the float32 state matches to ~1e-5 and the bf16 output differs by at most one bf16
rounding (2^-8 relative; the CPU interpreter truncates instead of rounding, 2^-7):
atol = rtol = 1.6e-2. A bf16 state pool gets the same one-rounding tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvloom.kernels.causal_conv1d import causal_conv1d_update
from kvloom.kernels.causal_conv1d_triton import causal_conv1d_update_triton
from kvloom.kernels.gated_delta_rule import recurrent_gated_delta_rule
from kvloom.kernels.gated_delta_rule_triton import (
    recurrent_gated_delta_rule_triton,
    recurrent_kda_triton,
)
from kvloom.kernels.kda import recurrent_kda

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")

STATE_TOL = (2e-5, 2e-5)  # float32 state, any activation dtype
OUT_TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
HALF_STORE_TOL = (1.6e-2, 1.6e-2)  # a bf16 state pool: one rounding of the stored value


def randn(*shape, gen: torch.Generator, dtype=torch.float32, scale: float = 1.0):
    """Fresh normal values made on the CPU (same on every device), moved to DEVICE."""
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


def make_slots(num_rows: int, num_pad: int, num_slots: int, gen: torch.Generator):
    """Distinct slots for the real rows, negative indices (-1 and others) for padding rows
    spread among them; returns (state_indices int32, used slot list)."""
    slots = torch.randperm(num_slots, generator=gen)[:num_rows].tolist()
    pad_rows = torch.randperm(num_rows, generator=gen)[:num_pad].tolist()
    for i, row in enumerate(pad_rows):
        slots[row] = -1 - 3 * i
    used = [s for s in slots if s >= 0]
    return torch.tensor(slots, dtype=torch.int32, device=DEVICE), used


def make_pool(shape, used, gen: torch.Generator, dtype=torch.float32):
    """Random pool; slots no row uses hold NaN (as freed slots do under the sanitizer)."""
    pool = randn(*shape, gen=gen).to(dtype)
    unused = [s for s in range(shape[0]) if s not in used]
    pool[unused] = float("nan")
    return pool


def poison_padding_rows(indices: torch.Tensor, *tensors: torch.Tensor) -> None:
    pad = indices < 0
    for t in tensors:
        t[pad] = float("nan")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])


def check_pools(name, pool, ref_pool, before, used, tol):
    """Used slots close to the reference; every other slot bitwise as it was."""
    unused = [s for s in range(pool.shape[0]) if s not in used]
    assert torch.equal(bits(pool[unused]), bits(before[unused])), f"{name}: unused slot written"
    assert not torch.isnan(pool[used]).any(), f"{name}: NaN in a used slot"
    torch.testing.assert_close(pool[used], ref_pool[used], atol=tol[0], rtol=tol[1])


def check_out(name, out, ref, indices, dtype):
    assert out.dtype == ref.dtype, f"{name}: dtype {out.dtype} != {ref.dtype}"
    assert not torch.isnan(out).any(), f"{name}: NaN in the output"
    pad = indices < 0
    assert torch.equal(out[pad], torch.zeros_like(out[pad])), f"{name}: padding row not zero"
    atol, rtol = OUT_TOL[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


# ----------------------------------------------------------------------------- delta rule


def delta_rule_inputs(n, hk, hv, dk, dv, dtype, per_channel, l2norm, strided, gen, qk_scale=None):
    """q, k, v, g, beta of N decode rows. `strided` cuts q/k/v from one mixed projection
    as the layer does (row stride larger than the heads)."""
    if qk_scale is None:
        qk_scale = 1.0 if l2norm else dk**-0.5
    if strided:
        mixed = randn(n, 2 * hk * dk + hv * dv, gen=gen, dtype=dtype)
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q, k = (q * qk_scale).view(n, hk, dk), (k * qk_scale).view(n, hk, dk)
        v = v.view(n, hv, dv)
    else:
        q = randn(n, hk, dk, gen=gen, dtype=dtype, scale=qk_scale)
        k = randn(n, hk, dk, gen=gen, dtype=dtype, scale=qk_scale)
        v = randn(n, hv, dv, gen=gen, dtype=dtype)
    g_shape = (n, hv, dk) if per_channel else (n, hv)
    g = -F.softplus(randn(*g_shape, gen=gen))  # log-decay <= 0, float32 as the layers make it
    beta = torch.sigmoid(randn(n, hv, gen=gen)).to(dtype)
    return q, k, v, g, beta


DELTA_CASES = [
    # n, pad, hk, hv, dk, dv, dtype, kda, l2norm, scale, strided, block_v
    pytest.param(1, 0, 2, 2, 24, 40, torch.float32, False, True, None, False, None, id="n1"),
    pytest.param(
        6, 2, 2, 4, 24, 40, torch.float32, False, True, None, True, 16, id="gqa-pad-strided"
    ),
    pytest.param(3, 1, 1, 2, 128, 128, torch.float32, False, True, None, False, None, id="d128"),
    pytest.param(4, 1, 1, 1, 40, 24, torch.float32, False, False, 0.37, False, 8, id="no-l2"),
    pytest.param(5, 2, 2, 4, 24, 40, torch.bfloat16, False, True, None, True, 16, id="bf16"),
    pytest.param(3, 1, 2, 4, 24, 40, torch.float16, False, True, None, False, 16, id="fp16"),
    pytest.param(5, 2, 2, 4, 24, 40, torch.float32, True, True, None, False, 16, id="kda"),
    pytest.param(4, 1, 1, 2, 40, 24, torch.bfloat16, True, True, None, True, None, id="kda-bf16"),
]


@pytest.mark.parametrize(
    "n, pad, hk, hv, dk, dv, dtype, kda, l2norm, scale, strided, block_v", DELTA_CASES
)
def test_delta_rule_decode_matches_reference(
    n, pad, hk, hv, dk, dv, dtype, kda, l2norm, scale, strided, block_v
):
    gen = torch.Generator().manual_seed(1000 * n + 10 * dk + dv + kda)
    q, k, v, g, beta = delta_rule_inputs(n, hk, hv, dk, dv, dtype, kda, l2norm, strided, gen)
    indices, used = make_slots(n, pad, n + 3, gen)
    poison_padding_rows(indices, q, k, v, g, beta)
    pool = make_pool((n + 3, hv, dk, dv), used, gen)
    before, ref_pool = pool.clone(), pool.clone()
    reference = recurrent_kda if kda else recurrent_gated_delta_rule
    kernel = recurrent_kda_triton if kda else recurrent_gated_delta_rule_triton
    kwargs = dict(scale=scale, use_qk_l2norm=l2norm)
    ref = reference(q, k, v, g, beta, ref_pool, indices, **kwargs)
    out = kernel(q, k, v, g, beta, pool, indices, _block_v_override=block_v, **kwargs)
    check_out("delta rule", out, ref, indices, dtype)
    check_pools("delta rule", pool, ref_pool, before, used, STATE_TOL)


def test_delta_rule_l2norm_epsilon_matters_for_tiny_vectors():
    """q and k with squared norms near the epsilon: the kernel must use l2norm's eps."""
    gen = torch.Generator().manual_seed(5)
    n, hk, hv, dk, dv = 3, 1, 2, 24, 24
    q, k, v, g, beta = delta_rule_inputs(
        n, hk, hv, dk, dv, torch.float32, False, True, False, gen, qk_scale=3e-4
    )
    indices, used = make_slots(n, 0, n, gen)
    pool = make_pool((n, hv, dk, dv), used, gen)
    ref_pool = pool.clone()
    ref = recurrent_gated_delta_rule(q, k, v, g, beta, ref_pool, indices, use_qk_l2norm=True)
    out = recurrent_gated_delta_rule_triton(q, k, v, g, beta, pool, indices, use_qk_l2norm=True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(pool, ref_pool, atol=2e-5, rtol=2e-5)


def test_delta_rule_half_state_pool_and_int64_indices():
    """A bfloat16 state pool (the layers' spec dtype may be bf16): computed in float32,
    stored rounded once, like the reference."""
    gen = torch.Generator().manual_seed(7)
    n, hk, hv, dk, dv = 4, 1, 2, 24, 40
    q, k, v, g, beta = delta_rule_inputs(n, hk, hv, dk, dv, torch.bfloat16, False, True, False, gen)
    indices, used = make_slots(n, 1, n + 2, gen)
    indices = indices.to(torch.int64)
    poison_padding_rows(indices, q, k, v, g, beta)
    pool = make_pool((n + 2, hv, dk, dv), used, gen, dtype=torch.bfloat16)
    before, ref_pool = pool.clone(), pool.clone()
    ref = recurrent_gated_delta_rule(q, k, v, g, beta, ref_pool, indices, use_qk_l2norm=True)
    out = recurrent_gated_delta_rule_triton(q, k, v, g, beta, pool, indices, use_qk_l2norm=True)
    check_out("delta rule bf16 pool", out, ref, indices, torch.bfloat16)
    check_pools("delta rule bf16 pool", pool, ref_pool, before, used, HALF_STORE_TOL)


def test_delta_rule_two_steps_continue_the_state():
    """Two consecutive steps through the pool equal two reference steps (the state written
    back is the one the next step reads)."""
    gen = torch.Generator().manual_seed(11)
    n, hk, hv, dk, dv = 3, 1, 2, 24, 24
    indices, used = make_slots(n, 0, n + 1, gen)
    pool = make_pool((n + 1, hv, dk, dv), used, gen)
    ref_pool = pool.clone()
    for _ in range(2):
        q, k, v, g, beta = delta_rule_inputs(
            n, hk, hv, dk, dv, torch.float32, False, True, False, gen
        )
        ref = recurrent_gated_delta_rule(q, k, v, g, beta, ref_pool, indices, use_qk_l2norm=True)
        out = recurrent_gated_delta_rule_triton(q, k, v, g, beta, pool, indices, use_qk_l2norm=True)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(pool[used], ref_pool[used], atol=2e-5, rtol=2e-5)


# ----------------------------------------------------------------------------- conv1d

CONV_CASES = [
    # n, pad, channels, width, bias, dtype, activation, pool dtype, strided, block_c
    pytest.param(1, 0, 40, 4, True, torch.float32, "silu", torch.float32, False, None, id="n1"),
    pytest.param(
        6, 2, 100, 4, False, torch.float32, "silu", torch.float32, True, 32, id="pad-blocks"
    ),
    pytest.param(5, 2, 50, 2, True, torch.bfloat16, "silu", torch.float32, True, 16, id="w2-bf16"),
    pytest.param(4, 1, 36, 3, True, torch.float32, None, torch.float32, False, 16, id="w3-noact"),
    pytest.param(3, 1, 40, 4, True, torch.float16, "silu", torch.float32, False, 16, id="fp16"),
    pytest.param(
        4, 1, 72, 4, False, torch.bfloat16, "silu", torch.bfloat16, False, 32, id="bf16-pool"
    ),
]


@pytest.mark.parametrize(
    "n, pad, channels, width, has_bias, dtype, activation, pool_dtype, strided, block_c",
    CONV_CASES,
)
def test_conv1d_update_matches_reference(
    n, pad, channels, width, has_bias, dtype, activation, pool_dtype, strided, block_c
):
    gen = torch.Generator().manual_seed(100 * n + channels + width)
    x = randn(n, channels + 24, gen=gen, dtype=dtype)[:, 8 : 8 + channels]
    if not strided:
        x = x.contiguous()
    weight = randn(channels, width, gen=gen, dtype=dtype, scale=0.5)
    bias = randn(channels, gen=gen, dtype=dtype) if has_bias else None
    indices, used = make_slots(n, pad, n + 3, gen)
    poison_padding_rows(indices, x)
    pool = make_pool((n + 3, channels, width - 1), used, gen, dtype=pool_dtype)
    before, ref_pool = pool.clone(), pool.clone()
    ref = causal_conv1d_update(x, weight, bias, ref_pool, indices, activation)
    out = causal_conv1d_update_triton(
        x, weight, bias, pool, indices, activation, _block_channels=block_c
    )
    check_out("conv1d", out, ref, indices, dtype)
    tol = STATE_TOL if pool_dtype == torch.float32 else HALF_STORE_TOL
    check_pools("conv1d", pool, ref_pool, before, used, tol)
    # The state is a shift of exact values: bitwise the reference's.
    assert torch.equal(bits(pool[used]), bits(ref_pool[used]))


def test_zero_rows_launch_nothing():
    state = torch.full((2, 2, 8, 8), float("nan"), device=DEVICE)
    empty = torch.empty(0, 2, 8, device=DEVICE)
    none = torch.empty(0, dtype=torch.int32, device=DEVICE)
    out = recurrent_gated_delta_rule_triton(
        empty, empty, empty, empty[..., 0], empty[..., 0], state, none
    )
    assert out.shape == (0, 2, 8)
    pool = torch.full((2, 6, 3), float("nan"), device=DEVICE)
    x = torch.empty(0, 6, device=DEVICE)
    weight = torch.randn(6, 4).to(DEVICE)
    assert causal_conv1d_update_triton(x, weight, None, pool, none).shape == (0, 6)


# ----------------------------------------------------------------------------- bad input


def _delta_args(**over):
    n, hk, hv, dk, dv = 2, 1, 2, 8, 8
    args = dict(
        q=torch.randn(n, hk, dk),
        k=torch.randn(n, hk, dk),
        v=torch.randn(n, hv, dv),
        g=-torch.rand(n, hv),
        beta=torch.rand(n, hv),
        state=torch.randn(3, hv, dk, dv),
        state_indices=torch.tensor([0, 1], dtype=torch.int32),
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "field, over",
    [
        ("q", dict(q=torch.randn(2, 8))),
        ("k", dict(k=torch.randn(2, 1, 4))),
        ("v", dict(v=torch.randn(3, 2, 8))),
        ("v", dict(q=torch.randn(2, 3, 8), k=torch.randn(2, 3, 8))),
        ("g", dict(g=-torch.rand(2, 2, 8))),
        ("beta", dict(beta=torch.rand(3, 2))),
        ("state", dict(state=torch.randn(3, 2, 8, 4))),
        ("state", dict(state=torch.randn(3, 2, 8, 8, dtype=torch.float64))),
        ("state_indices", dict(state_indices=torch.tensor([0.0, 1.0]))),
        ("state_indices", dict(state_indices=torch.tensor([0], dtype=torch.int32))),
        ("q", dict(q=torch.randn(2, 1, 8, dtype=torch.float64))),
    ],
)
def test_delta_rule_bad_input_names_the_field(field, over):
    args = _delta_args(**over)
    with pytest.raises(ValueError, match=f"^{field}:"):
        recurrent_gated_delta_rule_triton(**args)


def test_kda_requires_per_channel_decay():
    with pytest.raises(ValueError, match="^g:"):
        recurrent_kda_triton(**_delta_args())


@pytest.mark.parametrize(
    "field, over",
    [
        ("x", dict(x=torch.randn(2, 6, 1))),
        ("weight", dict(weight=torch.randn(5, 4))),
        ("bias", dict(bias=torch.randn(5))),
        ("conv_state_pool", dict(conv_state_pool=torch.randn(3, 6, 4))),
        ("state_indices", dict(state_indices=torch.tensor([0, 1, 2], dtype=torch.int32))),
        ("activation", dict(activation="gelu")),
        ("x", dict(x=torch.randn(2, 6, dtype=torch.float64))),
    ],
)
def test_conv1d_bad_input_names_the_field(field, over):
    args = dict(
        x=torch.randn(2, 6),
        weight=torch.randn(6, 4),
        bias=None,
        conv_state_pool=torch.randn(3, 6, 3),
        state_indices=torch.tensor([0, 1], dtype=torch.int32),
        activation="silu",
    )
    args.update(over)
    with pytest.raises(ValueError, match=f"^{field}:"):
        causal_conv1d_update_triton(**args)


# ----------------------------------------------------------------------------- GPU


HK, HV, DK, DV, CONV_CHANNELS, CONV_WIDTH = 16, 32, 128, 128, 8192, 4  # Qwen3-Next


def _split_heads(x):
    q, k, v = x.split([HK * DK, HK * DK, HV * DV], dim=-1)
    n = x.shape[0]
    return q.view(n, HK, DK), k.view(n, HK, DK), v.view(n, HV, DV)


def _qwen3_next_decode(mixed, weight, conv_pool, g, beta, rec_pool, indices):
    """The Qwen3-Next GDN decode core on the Triton kernels: conv over q|k|v, split heads
    (strided views), one delta-rule step. Returns (conv output, core output)."""
    x = causal_conv1d_update_triton(mixed, weight, None, conv_pool, indices, "silu")
    out = recurrent_gated_delta_rule_triton(
        *_split_heads(x), g, beta, rec_pool, indices, use_qk_l2norm=True
    )
    return x, out


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [1, 64, 256])
def test_gpu_qwen3_next_decode_shape_and_cuda_graph(n):
    gen = torch.Generator().manual_seed(n)
    num_slots = n + 4
    indices, used = make_slots(n, 0 if n == 1 else 3, num_slots, gen)
    mixed = randn(n, CONV_CHANNELS, gen=gen, dtype=torch.bfloat16)
    weight = randn(CONV_CHANNELS, CONV_WIDTH, gen=gen, dtype=torch.bfloat16, scale=0.5)
    g = -F.softplus(randn(n, HV, gen=gen))
    beta = torch.sigmoid(randn(n, HV, gen=gen)).to(torch.bfloat16)
    poison_padding_rows(indices, mixed, g, beta)
    conv_init = make_pool((num_slots, CONV_CHANNELS, CONV_WIDTH - 1), used, gen)
    rec_init = make_pool((num_slots, HV, DK, DV), used, gen)

    def scratch():
        return conv_init.clone(), rec_init.clone()

    # Eager, with any host synchronisation turned into an error (compiled first).
    warm_conv, warm_rec = scratch()
    _qwen3_next_decode(mixed, weight, warm_conv, g, beta, warm_rec, indices)
    torch.cuda.synchronize()
    eager_conv, eager_rec = scratch()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager_x, eager = _qwen3_next_decode(mixed, weight, eager_conv, g, beta, eager_rec, indices)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    # Each kernel against its reference on the same inputs (the delta rule is fed the
    # Triton conv output: a one-ulp bf16 difference in x would otherwise move the state).
    ref_conv, ref_rec = scratch()
    ref_x = causal_conv1d_update(mixed, weight, None, ref_conv, indices, "silu")
    check_out("gpu conv1d", eager_x, ref_x, indices, torch.bfloat16)
    check_pools("gpu conv state", eager_conv, ref_conv, conv_init, used, STATE_TOL)
    ref = recurrent_gated_delta_rule(
        *_split_heads(eager_x), g, beta, ref_rec, indices, use_qk_l2norm=True
    )
    check_out("gpu delta rule", eager, ref, indices, torch.bfloat16)
    check_pools("gpu delta rule state", eager_rec, ref_rec, rec_init, used, STATE_TOL)

    # CUDA graph: capture (which runs nothing), then one replay from the initial pools.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on scratch pools, as torch recommends
        _qwen3_next_decode(mixed, weight, warm_conv, g, beta, warm_rec, indices)
    torch.cuda.current_stream().wait_stream(side)
    graph_conv, graph_rec = scratch()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_x, captured = _qwen3_next_decode(
            mixed, weight, graph_conv, g, beta, graph_rec, indices
        )
    torch.cuda.synchronize()
    assert torch.equal(bits(graph_rec), bits(rec_init)), "capture must not run the kernels"
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(captured_x), bits(eager_x))
    assert torch.equal(bits(captured), bits(eager))
    assert torch.equal(bits(graph_rec), bits(eager_rec))
    assert torch.equal(bits(graph_conv), bits(eager_conv))
