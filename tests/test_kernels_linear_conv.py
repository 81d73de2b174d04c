"""Reference causal conv1d (varlen forward with carried state, one-step update).

Oracles: transformers' torch fallbacks `causal_conv1d_fn` / `causal_conv1d_update` as
Qwen3-Next and Kimi-Linear call them (their state keeps K columns; ours the last K-1).
"""

import inspect

import pytest
import torch
from transformers.models.kimi_linear import modeling_kimi_linear as kimi
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

from kvloom.kernels.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen

HF_CONV_FN = inspect.unwrap(qwen3_next.causal_conv1d_fn)
HF_CONV_UPDATE = inspect.unwrap(qwen3_next.causal_conv1d_update)
DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.float64, id="f64")]
CHANNELS, WIDTH = 6, 4
# Max abs errors measured vs transformers: 4.8e-7 (f32), 1.3e-15 (f64).
TOL = {torch.float32: 2e-6, torch.float64: 1e-13}


def randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def params(dtype, seed, with_bias=True):
    weight = randn(CHANNELS, WIDTH, dtype=dtype, seed=seed)
    return weight, (randn(CHANNELS, dtype=dtype, seed=seed + 1) if with_bias else None)


def cu_of(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def max_err(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().amax().item() if a.numel() else 0.0


def hf_prefill(x_seq, state, weight, bias, activation):
    """transformers' cached prefill: prepend the carried inputs, convolve, keep the new part.
    x_seq [L, C], state [C, K-1] -> (y [L, C], new state [C, K-1])."""
    full = torch.cat([state, x_seq.T], dim=-1)[None]
    new_part = slice(full.shape[-1] - x_seq.shape[0], None)  # not [-L:]: L may be 0
    y = HF_CONV_FN(full, weight, bias, activation=activation)[0, :, new_part].T
    return y, full[0, :, -(WIDTH - 1) :]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", None])
def test_varlen_without_state_matches_transformers(dtype, activation):
    lens = [1, 2, 3, 5, 17]
    x = randn(sum(lens), CHANNELS, dtype=dtype, seed=1)
    weight, bias = params(dtype, seed=2)
    y, new_state = causal_conv1d_varlen(x, weight, bias, cu_of(lens), None, None, activation)
    bounds = cu_of(lens).tolist()
    for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
        ref = HF_CONV_FN(x[start:end].T[None], weight, bias, activation=activation)[0].T
        assert max_err(y[start:end], ref) < TOL[dtype]
        _, ref_state = hf_prefill(
            x[start:end], torch.zeros(CHANNELS, WIDTH - 1, dtype=dtype), weight, bias, activation
        )
        assert torch.equal(new_state[n], ref_state)
    assert y.dtype == dtype and new_state.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_with_state_matches_transformers_cached_prefill(dtype):
    lens = [1, 2, 3, 4, 9, 0]
    x = randn(sum(lens), CHANNELS, dtype=dtype, seed=11)
    weight, bias = params(dtype, seed=12)
    state = randn(len(lens), CHANNELS, WIDTH - 1, dtype=dtype, seed=13)
    has_state = torch.tensor([True, True, False, True, False, True])
    y, new_state = causal_conv1d_varlen(x, weight, bias, cu_of(lens), state, has_state)
    bounds = cu_of(lens).tolist()
    for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
        carried = state[n] if has_state[n] else torch.zeros_like(state[n])
        ref_y, ref_state = hf_prefill(x[start:end], carried, weight, bias, "silu")
        assert max_err(y[start:end], ref_y) < TOL[dtype]
        assert torch.equal(new_state[n], ref_state)


def test_short_sequences_shift_in_old_state():
    """Spelled out for K = 4: the new state is the last 3 inputs, old ones shifted in."""
    weight, bias = params(torch.float64, seed=21)
    old = torch.arange(2 * CHANNELS * 3, dtype=torch.float64).view(2, CHANNELS, 3) + 100
    x = -torch.arange(3 * CHANNELS, dtype=torch.float64).view(3, CHANNELS) - 1
    _, new_state = causal_conv1d_varlen(
        x, weight, bias, cu_of([1, 2]), old, torch.tensor([True, False])
    )
    assert torch.equal(new_state[0], torch.cat([old[0][:, 1:], x[0:1].T], dim=1))
    zero = torch.zeros(CHANNELS, 1, dtype=torch.float64)
    assert torch.equal(new_state[1], torch.cat([zero, x[1:3].T], dim=1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_absent_state_is_never_read(dtype):
    lens = [1, 5, 2]
    x = randn(sum(lens), CHANNELS, dtype=dtype, seed=31)
    weight, bias = params(dtype, seed=32)
    garbage = torch.full((3, CHANNELS, WIDTH - 1), float("nan"), dtype=dtype)
    fresh = torch.tensor([False, False, False])
    y, new_state = causal_conv1d_varlen(x, weight, bias, cu_of(lens), garbage, fresh)
    ref_y, ref_state = causal_conv1d_varlen(x, weight, bias, cu_of(lens), None, None)
    assert torch.isfinite(y).all() and torch.isfinite(new_state).all()
    assert torch.equal(y, ref_y) and torch.equal(new_state, ref_state)


@pytest.mark.parametrize("dtype", DTYPES)
def test_update_matches_transformers(dtype):
    num = 3
    x = randn(num, CHANNELS, dtype=dtype, seed=41)
    weight, bias = params(dtype, seed=42)
    pool = randn(num, CHANNELS, WIDTH - 1, dtype=dtype, seed=43)
    # transformers keeps K columns; its oldest never reaches an output (NaN proves it).
    hf_state = torch.cat([torch.full((num, CHANNELS, 1), float("nan"), dtype=dtype), pool], -1)
    y = causal_conv1d_update(x, weight, bias, pool, torch.arange(num), "silu")
    ref = HF_CONV_UPDATE(x[:, :, None], hf_state, weight, bias, "silu")[:, :, 0]
    assert max_err(y, ref) < TOL[dtype]
    assert torch.equal(pool, hf_state[..., 1:])


def test_kimi_linear_uses_the_same_conv():
    """Kimi-Linear's fallbacks compute exactly what Qwen3-Next's do (one oracle serves both)."""
    x = randn(1, CHANNELS, 9, dtype=torch.float32, seed=45)
    weight, bias = params(torch.float32, seed=46)
    kimi_fn, kimi_update = (
        inspect.unwrap(f) for f in (kimi.causal_conv1d_fn, kimi.causal_conv1d_update)
    )
    assert torch.equal(kimi_fn(x, weight, bias, "silu"), HF_CONV_FN(x, weight, bias, "silu"))
    state = randn(1, CHANNELS, WIDTH, dtype=torch.float32, seed=47)
    a = kimi_update(x[..., :1], state.clone(), weight, bias, "silu")
    assert torch.equal(a, HF_CONV_UPDATE(x[..., :1], state.clone(), weight, bias, "silu"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_then_updates_then_prefill_equals_one_pass(dtype):
    first, steps, rest = 2, 4, 7
    total = first + steps + rest
    x = randn(total, CHANNELS, dtype=dtype, seed=51)
    weight, bias = params(dtype, seed=52)
    whole_y, whole_state = causal_conv1d_varlen(x, weight, bias, cu_of([total]), None, None)

    y_a, state = causal_conv1d_varlen(x[:first], weight, bias, cu_of([first]), None, None)
    pool = torch.full((3, CHANNELS, WIDTH - 1), float("nan"), dtype=dtype)
    pool[1] = state[0]
    step_ys = [
        causal_conv1d_update(x[t : t + 1], weight, bias, pool, torch.tensor([1]))
        for t in range(first, first + steps)
    ]
    y_c, final = causal_conv1d_varlen(
        x[first + steps :], weight, bias, cu_of([rest]), pool[1:2], torch.tensor([True])
    )
    assert max_err(torch.cat([y_a, *step_ys, y_c]), whole_y) < TOL[dtype]
    assert torch.equal(final, whole_state)


@pytest.mark.parametrize("dtype", DTYPES)
def test_update_leaves_padding_and_other_slots_alone(dtype):
    x = randn(4, CHANNELS, dtype=dtype, seed=61)
    weight, bias = params(dtype, seed=62)
    pool = randn(5, CHANNELS, WIDTH - 1, dtype=dtype, seed=63)
    pool[2] = float("nan")  # a freed slot
    before = pool.clone()
    y = causal_conv1d_update(x, weight, bias, pool, torch.tensor([-1, 4, -1, 0]))
    assert torch.equal(y[[0, 2]], torch.zeros(2, CHANNELS, dtype=dtype))
    assert torch.equal(pool[[1, 3]], before[[1, 3]]) and pool[2].isnan().all()
    for row, slot in ((1, 4), (3, 0)):
        ref_y, ref_state = hf_prefill(x[row : row + 1], before[slot], weight, bias, "silu")
        assert max_err(y[row], ref_y[0]) < TOL[dtype]
        assert torch.equal(pool[slot], ref_state)


def test_low_precision_input_keeps_its_dtype():
    lens = [3, 6]
    x = randn(sum(lens), CHANNELS, dtype=torch.float32, seed=71).to(torch.bfloat16)
    weight, bias = params(torch.float32, seed=72)
    state = randn(2, CHANNELS, WIDTH - 1, dtype=torch.float32, seed=73)
    has_state = torch.tensor([True, True])
    y, new_state = causal_conv1d_varlen(x, weight, bias, cu_of(lens), state, has_state)
    ref_y, ref_state = causal_conv1d_varlen(x.float(), weight, bias, cu_of(lens), state, has_state)
    assert y.dtype == torch.bfloat16 and new_state.dtype == torch.float32
    assert torch.equal(y, ref_y.to(torch.bfloat16)) and torch.equal(new_state, ref_state)


def test_bad_input_names_the_field():
    x = randn(5, CHANNELS, dtype=torch.float32, seed=81)
    weight, bias = params(torch.float32, seed=82)
    state = randn(2, CHANNELS, WIDTH - 1, dtype=torch.float32, seed=83)
    has_state = torch.tensor([True, False])
    cu = cu_of([2, 3])
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_varlen(x, weight, bias, cu, state, has_state, activation="gelu")
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d_varlen(x, weight[:-1], bias, cu, state, has_state)
    with pytest.raises(ValueError, match="bias"):
        causal_conv1d_varlen(x, weight, bias[:-1], cu, state, has_state)
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d_varlen(x, weight, bias, cu_of([2, 2]), state, has_state)
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_varlen(x, weight, bias, cu, state[..., :-1], has_state)
    with pytest.raises(ValueError, match="has_initial_state"):
        causal_conv1d_varlen(x, weight, bias, cu, state, None)
    with pytest.raises(ValueError, match="conv_state_pool"):
        causal_conv1d_update(x[:2], weight, bias, state[..., :-1], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="state_indices"):
        causal_conv1d_update(x[:2], weight, bias, state, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="state_indices"):
        causal_conv1d_update(x[:2], weight, bias, state, torch.tensor([0, 2]))
