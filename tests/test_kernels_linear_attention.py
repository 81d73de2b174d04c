"""Reference kernels for Gated DeltaNet (Qwen3-Next) and KDA (Kimi-Linear).

Oracles: transformers' own torch fallbacks (single sequences; they compute in float32) and a
plain per-token recurrence written here (any dtype, any packing).
"""

import inspect
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from transformers.models.kimi_linear import modeling_kimi_linear as kimi
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

from kvloom.kernels.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from kvloom.kernels.kda import chunk_kda, kda_log_decay, recurrent_kda

# transformers may route these to fla when it is installed; unwrap to the torch fallbacks.
HF_GDN_CHUNK = inspect.unwrap(qwen3_next.torch_chunk_gated_delta_rule)
HF_GDN_RECURRENT = inspect.unwrap(qwen3_next.torch_recurrent_gated_delta_rule)
HF_KDA_CHUNK = inspect.unwrap(kimi.chunk_kimi_delta_attention)
HF_KDA_RECURRENT = inspect.unwrap(kimi.recurrent_kimi_delta_attention)


@dataclass(frozen=True)
class Variant:
    name: str
    per_channel_decay: bool
    key_heads: int
    value_heads: int
    chunk: object
    recurrent: object
    hf_chunk: object
    hf_recurrent: object


# GDN with grouped value heads (2 key heads serve 4 value heads), as Qwen3-Next has them.
GDN = Variant(
    name="gdn",
    per_channel_decay=False,
    key_heads=2,
    value_heads=4,
    chunk=chunk_gated_delta_rule,
    recurrent=recurrent_gated_delta_rule,
    hf_chunk=HF_GDN_CHUNK,
    hf_recurrent=HF_GDN_RECURRENT,
)
KDA = Variant(
    name="kda",
    per_channel_decay=True,
    key_heads=3,
    value_heads=3,
    chunk=chunk_kda,
    recurrent=recurrent_kda,
    hf_chunk=HF_KDA_CHUNK,
    hf_recurrent=HF_KDA_RECURRENT,
)
VARIANTS = [pytest.param(GDN, id="gdn"), pytest.param(KDA, id="kda")]
DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.float64, id="f64")]
HEAD_K, HEAD_V = 16, 8

# Max abs errors measured against the oracles: 5e-7 (f32) and 3e-15 (f64) vs the recurrence
# here, 3.2e-6 vs transformers' float32 fallbacks; the tolerances leave a margin of ~10x.
TOL = {torch.float32: 5e-6, torch.float64: 1e-12}
HF_TOL = 1e-5  # transformers computes in float32 whatever the input dtype


def make_inputs(variant, num_tokens, dtype, *, seed, decay_scale=1.0, unit_keys=False):
    """Fresh random q, k, v, g (<= 0), beta. unit_keys scales k to norm ~1 so the recurrence
    stays bounded without the in-kernel L2 norm."""
    gen = torch.Generator().manual_seed(seed)
    hk, hv = variant.key_heads, variant.value_heads
    q = torch.randn(num_tokens, hk, HEAD_K, generator=gen, dtype=dtype)
    k = torch.randn(num_tokens, hk, HEAD_K, generator=gen, dtype=dtype)
    if unit_keys:
        k = k / HEAD_K**0.5
    v = torch.randn(num_tokens, hv, HEAD_V, generator=gen, dtype=dtype)
    gate_shape = (num_tokens, hv, HEAD_K) if variant.per_channel_decay else (num_tokens, hv)
    rate = torch.rand(gate_shape[1:], generator=gen, dtype=dtype) * 1.5 + 0.05
    g = -rate * F.softplus(torch.randn(gate_shape, generator=gen, dtype=dtype)) * decay_scale
    beta = torch.sigmoid(torch.randn(num_tokens, hv, generator=gen, dtype=dtype))
    return q, k, v, g, beta


def make_states(variant, num, dtype, *, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num, variant.value_heads, HEAD_K, HEAD_V, generator=gen, dtype=dtype)


def cu_of(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def naive_recurrence(q, k, v, g, beta, cu, state0, has_state, *, scale=None, l2norm=False):
    """Token-by-token delta rule per sequence, in the inputs' dtype."""
    group = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(group, 1), k.repeat_interleave(group, 1)
    if l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    out = torch.zeros_like(v)
    finals = []
    bounds = cu.tolist()
    for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
        heads, dk, dv = v.shape[1], q.shape[-1], v.shape[-1]
        s = state0[n].clone() if has_state[n] else torch.zeros(heads, dk, dv, dtype=v.dtype)
        for t in range(start, end):
            decay = g[t].exp()
            s = s * (decay[:, :, None] if decay.dim() == 2 else decay[:, None, None])
            predicted = torch.einsum("hk,hkv->hv", k[t], s)
            s = s + k[t][:, :, None] * (beta[t][:, None] * (v[t] - predicted))[:, None, :]
            out[t] = torch.einsum("hk,hkv->hv", q[t], s)
        finals.append(s)
    return out, torch.stack(finals)


def max_err(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().amax().item() if a.numel() else 0.0


# ----------------------------------------------------------------------------- transformers


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length", [1, 63, 64, 65, 150])
def test_chunk_matches_transformers_fallback(variant, dtype, length):
    q, k, v, g, beta = make_inputs(variant, length, dtype, seed=length)
    state0 = make_states(variant, 1, dtype, seed=length + 1)
    out, final = variant.chunk(
        q, k, v, g, beta, cu_of([length]), state0, torch.tensor([True]), use_qk_l2norm=True
    )
    for hf in (variant.hf_chunk, variant.hf_recurrent):
        ref_out, ref_final = hf(
            q[None],
            k[None],
            v[None],
            g[None],
            beta[None],
            initial_state=state0,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        assert max_err(out, ref_out[0]) < HF_TOL
        assert max_err(final, ref_final) < HF_TOL
    assert out.dtype == dtype and final.dtype == dtype


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_recurrent_matches_transformers_fallback(variant, dtype):
    num = 5
    q, k, v, g, beta = make_inputs(variant, num, dtype, seed=7)
    states = make_states(variant, num, dtype, seed=8)
    pool = states.clone()
    out = variant.recurrent(q, k, v, g, beta, pool, torch.arange(num), use_qk_l2norm=True)
    # transformers: batch of N one-token sequences
    ref_out, ref_final = variant.hf_recurrent(
        q[:, None],
        k[:, None],
        v[:, None],
        g[:, None],
        beta[:, None],
        initial_state=states,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert max_err(out, ref_out[:, 0]) < HF_TOL
    assert max_err(pool, ref_final) < HF_TOL


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("lens", "chunk_size"),
    [([1, 15, 16, 17, 40], 16), ([1, 63, 64, 65, 130], 64), ([3, 5], 64)],
    ids=["chunk16", "chunk64", "short"],
)
def test_chunked_equals_token_recurrence(variant, dtype, lens, chunk_size):
    q, k, v, g, beta = make_inputs(variant, sum(lens), dtype, seed=sum(lens))
    state0 = make_states(variant, len(lens), dtype, seed=3)
    has_state = torch.tensor([i % 2 == 0 for i in range(len(lens))])
    cu = cu_of(lens)
    out, final = variant.chunk(
        q, k, v, g, beta, cu, state0, has_state, use_qk_l2norm=True, chunk_size=chunk_size
    )
    ref_out, ref_final = naive_recurrence(q, k, v, g, beta, cu, state0, has_state, l2norm=True)
    assert max_err(out, ref_out) < TOL[dtype]
    assert max_err(final, ref_final) < TOL[dtype]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_custom_scale_without_l2norm(variant, dtype):
    lens = [20, 9]
    q, k, v, g, beta = make_inputs(variant, sum(lens), dtype, seed=11, unit_keys=True)
    state0 = make_states(variant, 2, dtype, seed=12)
    has_state = torch.tensor([True, True])
    out, final = variant.chunk(
        q, k, v, g, beta, cu_of(lens), state0, has_state, scale=0.3, chunk_size=8
    )
    ref_out, ref_final = naive_recurrence(
        q, k, v, g, beta, cu_of(lens), state0, has_state, scale=0.3
    )
    assert max_err(out, ref_out) < TOL[dtype]
    assert max_err(final, ref_final) < TOL[dtype]
    pool = state0.clone()
    step = variant.recurrent(
        q[:2], k[:2], v[:2], g[:2], beta[:2], pool, torch.tensor([0, 1]), scale=0.3
    )
    ref_step, ref_pool = naive_recurrence(
        q[:2], k[:2], v[:2], g[:2], beta[:2], cu_of([1, 1]), state0, has_state, scale=0.3
    )
    assert max_err(step, ref_step) < TOL[dtype]
    assert max_err(pool, ref_pool) < TOL[dtype]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_strong_decay_stays_finite_and_exact(variant, dtype):
    """Log-decays down to about -100 a token: cumulative sums of thousands inside a chunk."""
    lens = [64, 70]
    inputs = make_inputs(variant, sum(lens), torch.float64, seed=5, decay_scale=30.0)
    q, k, v, g, beta = (x.to(dtype) for x in inputs)
    state0 = make_states(variant, 2, torch.float64, seed=6).to(dtype)
    has_state = torch.tensor([True, True])
    out, final = variant.chunk(q, k, v, g, beta, cu_of(lens), state0, has_state, use_qk_l2norm=True)
    ref_out, ref_final = naive_recurrence(
        q, k, v, g, beta, cu_of(lens), state0, has_state, l2norm=True
    )
    assert g.min() < -50
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    assert max_err(out, ref_out) < TOL[dtype]
    assert max_err(final, ref_final) < TOL[dtype]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_equals_separate_runs(variant, dtype):
    lens = [65, 1, 0, 31, 64]
    q, k, v, g, beta = make_inputs(variant, sum(lens), dtype, seed=21)
    state0 = make_states(variant, len(lens), dtype, seed=22)
    has_state = torch.tensor([True, False, True, True, False])
    out, final = variant.chunk(q, k, v, g, beta, cu_of(lens), state0, has_state, use_qk_l2norm=True)
    bounds = cu_of(lens).tolist()
    for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
        part = slice(start, end)
        alone_out, alone_final = variant.chunk(
            q[part],
            k[part],
            v[part],
            g[part],
            beta[part],
            cu_of([end - start]),
            state0[n : n + 1],
            has_state[n : n + 1],
            use_qk_l2norm=True,
        )
        assert max_err(out[part], alone_out) < TOL[dtype]
        assert max_err(final[n], alone_final[0]) < TOL[dtype]
    # The empty sequence passes its state through (or zeros without one).
    assert torch.equal(final[2], state0[2])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunk_then_steps_then_chunk_equals_one_chunk(variant, dtype):
    """State continuity: prefill chunk, 3 decode steps, resumed chunk == one long chunk."""
    first, steps, rest = 37, 3, 70
    total = first + steps + rest
    q, k, v, g, beta = make_inputs(variant, total, dtype, seed=31)
    whole_out, whole_final = variant.chunk(q, k, v, g, beta, cu_of([total]), use_qk_l2norm=True)

    head = slice(0, first)
    out_a, state = variant.chunk(
        q[head], k[head], v[head], g[head], beta[head], cu_of([first]), use_qk_l2norm=True
    )
    pool = torch.full((4, *state.shape[1:]), float("nan"), dtype=dtype)
    pool[2] = state[0]
    step_outs = []
    for t in range(first, first + steps):
        one = slice(t, t + 1)
        step_outs.append(
            variant.recurrent(
                q[one],
                k[one],
                v[one],
                g[one],
                beta[one],
                pool,
                torch.tensor([2]),
                use_qk_l2norm=True,
            )
        )
    tail = slice(first + steps, total)
    out_c, final = variant.chunk(
        q[tail],
        k[tail],
        v[tail],
        g[tail],
        beta[tail],
        cu_of([rest]),
        pool[2:3],
        torch.tensor([True]),
        use_qk_l2norm=True,
    )
    pieces = torch.cat([out_a, *step_outs, out_c])
    assert max_err(pieces, whole_out) < TOL[dtype]
    assert max_err(final, whole_final) < TOL[dtype]


# ----------------------------------------------------------------------------- state hygiene


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_absent_initial_state_is_never_read(variant, dtype):
    lens = [1, 17, 64]
    q, k, v, g, beta = make_inputs(variant, sum(lens), dtype, seed=41)
    garbage = torch.full((3, variant.value_heads, HEAD_K, HEAD_V), float("nan"), dtype=dtype)
    garbage[1] = make_states(variant, 1, dtype, seed=42)[0]
    has_state = torch.tensor([False, True, False])
    out, final = variant.chunk(
        q, k, v, g, beta, cu_of(lens), garbage, has_state, use_qk_l2norm=True
    )
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    ref_out, ref_final = naive_recurrence(
        q, k, v, g, beta, cu_of(lens), garbage, has_state, l2norm=True
    )
    assert max_err(out, ref_out) < TOL[dtype]
    assert max_err(final, ref_final) < TOL[dtype]
    # All fresh: identical to passing no initial state at all.
    all_fresh = torch.tensor([False, False, False])
    out_nan, final_nan = variant.chunk(
        q, k, v, g, beta, cu_of(lens), garbage, all_fresh, use_qk_l2norm=True
    )
    out_none, final_none = variant.chunk(q, k, v, g, beta, cu_of(lens), use_qk_l2norm=True)
    assert torch.equal(out_nan, out_none) and torch.equal(final_nan, final_none)
    assert torch.isfinite(out_nan).all()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_recurrent_leaves_padding_and_other_slots_alone(variant, dtype):
    q, k, v, g, beta = make_inputs(variant, 4, dtype, seed=51)
    pool = make_states(variant, 6, dtype, seed=52)
    pool[1] = float("nan")  # a freed slot: must stay NaN and never leak
    before = pool.clone()
    indices = torch.tensor([3, -1, 0, -1], dtype=torch.int64)
    out = variant.recurrent(q, k, v, g, beta, pool, indices, use_qk_l2norm=True)
    for row in (1, 3):
        assert torch.equal(out[row], torch.zeros_like(out[row]))
    untouched = [1, 2, 4, 5]
    assert torch.equal(pool[untouched].isnan(), before[untouched].isnan())
    assert torch.equal(pool[[2, 4, 5]], before[[2, 4, 5]])
    live = torch.tensor([0, 2])
    ref_out, ref_state = naive_recurrence(
        q[live],
        k[live],
        v[live],
        g[live],
        beta[live],
        cu_of([1, 1]),
        before[[3, 0]],
        torch.tensor([True, True]),
        l2norm=True,
    )
    assert max_err(out[live], ref_out) < TOL[dtype]
    assert max_err(pool[[3, 0]], ref_state) < TOL[dtype]
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_low_precision_inputs_compute_in_float32(variant):
    """bf16 activations with a float32 state pool: same math as float32, outputs in bf16."""
    lens = [5, 70]
    q, k, v, g, beta = make_inputs(variant, sum(lens), torch.float32, seed=61)
    low = [x.to(torch.bfloat16) for x in (q, k, v)]
    state0 = make_states(variant, 2, torch.float32, seed=62)
    has_state = torch.tensor([True, False])
    out, final = variant.chunk(*low, g, beta, cu_of(lens), state0, has_state, use_qk_l2norm=True)
    ref_out, ref_final = variant.chunk(
        *(x.float() for x in low), g, beta, cu_of(lens), state0, has_state, use_qk_l2norm=True
    )
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert torch.equal(out, ref_out.to(torch.bfloat16)) and torch.equal(final, ref_final)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("variant", VARIANTS)
def test_bad_input_names_the_field(variant):
    q, k, v, g, beta = make_inputs(variant, 6, torch.float32, seed=71)
    state0 = make_states(variant, 2, torch.float32, seed=72)
    has_state = torch.tensor([True, False])

    def chunk(**over):
        args = (
            dict(
                q=q,
                k=k,
                v=v,
                g=g,
                beta=beta,
                cu_seqlens=cu_of([2, 4]),
                initial_state=state0,
                has_initial_state=has_state,
            )
            | over
        )
        return variant.chunk(**args)

    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk(cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk(cu_seqlens=torch.tensor([0, 4, 2, 6]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk(cu_seqlens=torch.tensor([0.0, 2.0, 6.0]))
    with pytest.raises(ValueError, match="g:"):
        chunk(g=g[:-1])
    with pytest.raises(ValueError, match="beta"):
        chunk(beta=beta[:, :1])
    with pytest.raises(ValueError, match="k:"):
        chunk(k=k[:, :, :-1])
    with pytest.raises(ValueError, match="v:"):
        chunk(v=v[:, :1].expand(-1, variant.key_heads + 1, -1))
    with pytest.raises(ValueError, match="has_initial_state"):
        chunk(has_initial_state=None)
    with pytest.raises(ValueError, match="has_initial_state"):
        chunk(has_initial_state=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="initial_state"):
        chunk(initial_state=state0[:1])
    with pytest.raises(ValueError, match="chunk_size"):
        variant.chunk(q, k, v, g, beta, cu_of([6]), chunk_size=0)

    pool = make_states(variant, 3, torch.float32, seed=73)
    rows = slice(0, 2)

    def step(indices):
        return variant.recurrent(q[rows], k[rows], v[rows], g[rows], beta[rows], pool, indices)

    with pytest.raises(ValueError, match="state_indices"):
        step(torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="state_indices"):
        step(torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="state_indices"):
        step(torch.tensor([0]))
    with pytest.raises(ValueError, match="state"):
        variant.recurrent(
            q[rows], k[rows], v[rows], g[rows], beta[rows], pool[:, :1], torch.tensor([0, 1])
        )


# ----------------------------------------------------------------------------- KDA gate


@pytest.mark.parametrize("dtype", DTYPES)
def test_kda_log_decay_matches_kimi_forget_gate(dtype):
    from transformers import KimiLinearConfig

    config = KimiLinearConfig(hidden_size=32, linear_head_dim=8, linear_num_heads=3)
    gate = kimi.KimiLinearForgetGate(config).to(dtype)
    gen = torch.Generator().manual_seed(81)
    with torch.no_grad():
        for param in gate.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, dtype=dtype) * 3)
        gate.A_log.copy_(torch.empty_like(gate.A_log).uniform_(1, 16, generator=gen).log())
        hidden = torch.randn(2, 5, 32, generator=gen, dtype=dtype)
        expected = gate(hidden)
        raw = gate.f_b_proj(gate.f_a_proj(hidden)).view(2, 5, 3, 8)
        got = kda_log_decay(raw, gate.A_log, gate.dt_bias)
    assert (raw + gate.dt_bias.view(3, 8) > 20).any()  # the linear branch of softplus is hit
    # transformers computes this in float32 (its log(1 + exp(x)) rounds to 0 below x ~ -17)
    assert expected.dtype == torch.float32 and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=1e-5, atol=1e-6)
    assert (got <= 0).all()
