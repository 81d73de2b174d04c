"""Gated DeltaNet prefill on fla-core's chunked kernels against the torch reference.

The `gpu` tests run fla at Qwen3-Next head shapes (Hk=16 key heads, Hv=32 value heads,
Dk=Dv=128) on packed sequences of lengths around the 64-token chunk edge, with and without
an initial state, NaN in the state rows whose has_initial_state is False (as the sanitizer
leaves free slots).

fla cannot run in Triton's CPU interpreter (its autotuner asks for a GPU driver to
benchmark, and with one config forced, `chunk_delta_h` fails in the interpreter with
"'int' object has no attribute 'to'"), so on CPU only the dispatcher and the wrapper's
input checks are tested.

Tolerances, as relative Frobenius error norms |fla - ref| / |ref| (the reference computes
in float32 from the same inputs), each checked per sequence as well:
  float32 inputs: fla's tl.dot runs in TF32 on the GPU (10-bit mantissa, 2^-11 relative
    per product) over chains of ~4 matmuls per chunk: 5e-3 (seen on an H200: <= 1.6e-3).
  float16 inputs: fla keeps normalised q/k, its WY terms and per-chunk states in fp16
    (also 2^-11 per rounding): 5e-3 (seen: <= 5.5e-4).
  bfloat16 inputs: the same intermediates in bf16 (2^-9 relative per rounding, several
    roundings per chunk, carried across chunks) plus the bf16 output: 1e-2 (seen: <= 4.4e-3).
A wrong key-head grouping, scale, or a dropped initial state gives errors of order 1.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvloom.kernels import gated_delta_rule as gdn_ref
from kvloom.kernels import gated_delta_rule_fla as gdn_fla
from kvloom.kernels import ops
from kvloom.kernels.l2norm import l2norm

CUDA = torch.cuda.is_available()
HK, HV, DK, DV = 16, 32, 128, 128  # Qwen3-Next
LENGTHS = [1, 63, 64, 65, 300]
REL_TOL = {torch.float32: 5e-3, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def make_inputs(lengths, dtype, device, *, hk=HK, hv=HV, dk=DK, dv=DV, seed=0):
    """Packed random inputs with Qwen3-Next-like gates: g = -softplus(.) <= 0 (decays down
    to ~e^-3 per token), beta in (0, 1). Made on the CPU, so the same on every device."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = randn(total, hk, dk), randn(total, hk, dk)
    v = randn(total, hv, dv)
    g = -F.softplus(randn(total, hv))
    beta = torch.sigmoid(randn(total, hv))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    state = randn(len(lengths), hv, dk, dv) * 0.5
    as_dtype = [x.to(device=device, dtype=dtype) for x in (q, k, v)]
    return (*as_dtype, g.to(device), beta.to(device), cu.to(device), state.to(device))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm())


# ----------------------------------------------------------------------------- CPU


def test_fla_unavailable_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not gdn_fla.fla_available()


@pytest.mark.parametrize("no_fla", ["0", "1"])
def test_dispatcher_uses_reference_off_cuda_or_when_disabled(monkeypatch, no_fla):
    """On CPU (or KVLOOM_NO_FLA=1) the dispatcher is the reference, bit for bit, and never
    calls fla, even when fla claims to be available."""
    monkeypatch.setenv("KVLOOM_NO_FLA", no_fla)
    monkeypatch.setattr(gdn_fla, "fla_available", lambda: True)

    def must_not_run(*args, **kwargs):
        raise AssertionError("fla path taken for a CPU tensor")

    monkeypatch.setattr(gdn_fla, "chunk_gated_delta_rule_fla", must_not_run)
    q, k, v, g, beta, cu, state = make_inputs([3, 5], torch.float32, "cpu", hk=2, hv=4, dk=8, dv=8)
    has = torch.tensor([True, False])
    state[1] = float("nan")
    got = ops.chunk_gated_delta_rule(
        q, k, v, g, beta, cu, state, has, scale=0.3, use_qk_l2norm=True
    )
    want = gdn_ref.chunk_gated_delta_rule(
        q, k, v, g, beta, cu, state, has, scale=0.3, use_qk_l2norm=True
    )
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert not got[0].isnan().any() and not got[1].isnan().any()


def _good_args():
    q, k, v, g, beta, cu, state = make_inputs([2, 3], torch.float32, "cpu", hk=1, hv=2, dk=4, dv=4)
    return dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu, initial_state=state,
                has_initial_state=torch.tensor([True, False]))  # fmt: skip


@pytest.mark.parametrize(
    "field, change",
    [
        ("q", lambda a: a["q"].double()),
        ("v", lambda a: a["v"][:, :1].repeat(1, 3, 1)),  # 3 value heads, 2 key heads
        ("g", lambda a: a["g"][:, :1]),
        ("beta", lambda a: a["beta"].long()),
        ("cu_seqlens", lambda a: torch.tensor([0, 2, 4])),
        ("has_initial_state", lambda a: None),
    ],
)
def test_fla_wrapper_bad_input_names_the_field(field, change):
    """Checked before fla is imported, so this runs on CPU."""
    args = _good_args()
    args[field] = change(args)
    if field == "v":
        args["q"], args["k"] = args["q"].repeat(1, 2, 1), args["k"].repeat(1, 2, 1)
        args["g"], args["beta"] = args["g"][:, :1].repeat(1, 3), args["beta"][:, :1].repeat(1, 3)
    with pytest.raises(ValueError, match=field):
        gdn_fla.chunk_gated_delta_rule_fla(**args)


def _fake_fla(calls):
    def kernel(q, k, v, g, beta, **kw):
        calls.append(kw)
        return torch.zeros_like(v), kw["initial_state"].clone()

    return lambda: kernel


def test_fla_gets_the_layers_own_bound_objects():
    """fla keeps its chunk layout per bounds object and copies it to the device with a
    copy that waits for the stream: the layer's host bounds and their device copy must
    reach it as they are (the same objects in every layer of a step), so it waits once
    per step. Without a device copy the wrapper stages fresh bounds itself."""
    args = _good_args()
    args["cu_seqlens"] = args["cu_seqlens"].long()  # as the layers keep them
    cu_dev = args["cu_seqlens"].clone()  # "the device" is the CPU here
    calls = []
    for _ in range(2):  # two layers of one step
        gdn_fla.run_fla_varlen(
            _fake_fla(calls), args["q"], args["k"], args["v"], args["g"], args["beta"],
            args["cu_seqlens"], args["initial_state"], args["has_initial_state"], None, True,
            cu_dev,
        )  # fmt: skip
    assert all(c["cu_seqlens"] is cu_dev for c in calls)
    assert all(c["cu_seqlens_cpu"] is args["cu_seqlens"] for c in calls)
    calls.clear()
    gdn_fla.run_fla_varlen(
        _fake_fla(calls), args["q"], args["k"], args["v"], args["g"], args["beta"],
        args["cu_seqlens"].int(), args["initial_state"], args["has_initial_state"], None, True,
    )  # fmt: skip
    assert calls[0]["cu_seqlens_cpu"].dtype == torch.int64
    assert calls[0]["cu_seqlens_cpu"].tolist() == args["cu_seqlens"].tolist()
    assert calls[0]["cu_seqlens"].tolist() == args["cu_seqlens"].tolist()


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_fla_gets_unit_queries_and_keys_never_its_own_norm(use_qk_l2norm):
    """fla's l2norm launch re-runs its autotuner at each new size bucket of a step
    (seconds each on an H100): the wrapper normalises q and k itself (`l2norm_rows`) and
    always tells fla not to; without the norm asked for, q and k pass through as given."""
    args = _good_args()
    seen = []

    def kernel(q, k, v, g, beta, **kw):
        seen.append((q.squeeze(0), k.squeeze(0), kw["use_qk_l2norm_in_kernel"]))
        return torch.zeros_like(v), kw["initial_state"].clone()

    gdn_fla.run_fla_varlen(
        lambda: kernel, args["q"], args["k"], args["v"], args["g"], args["beta"],
        args["cu_seqlens"], args["initial_state"], args["has_initial_state"], None,
        use_qk_l2norm,
    )  # fmt: skip
    ((q, k, in_kernel),) = seen
    assert in_kernel is False
    if use_qk_l2norm:
        torch.testing.assert_close(q, l2norm(args["q"]))
        torch.testing.assert_close(k, l2norm(args["k"]))
    else:
        assert torch.equal(q, args["q"]) and torch.equal(k, args["k"])


@pytest.mark.parametrize("bad", [torch.tensor([0, 2]), torch.tensor([0, 2, 5], dtype=torch.int32)])
def test_fla_device_bounds_must_match_the_host_ones(bad):
    args = _good_args()
    with pytest.raises(ValueError, match="cu_seqlens_device"):
        gdn_fla.chunk_gated_delta_rule_fla(**args, cu_seqlens_device=bad)


@pytest.mark.parametrize("layout", ["fla", "device", "staged"])
def test_layout_switch_reaches_fla(monkeypatch, layout):
    """KVLOOM_FLA_LAYOUT=staged hands fla's chunk_gated_delta_rule kvloom's chunk layout
    (`chunk_indices`; fla makes the offsets on the device); fla's Gated DeltaNet has no
    graph form, so `device` gets fla's own layout, as `fla` does."""
    calls = []

    class FakeGdn:
        @staticmethod
        def chunk_gated_delta_rule(q, k, v, g, beta, **kw):
            calls.append(kw)
            return torch.zeros_like(v), kw["initial_state"].clone()

    monkeypatch.setenv("KVLOOM_FLA_LAYOUT", layout)
    monkeypatch.setattr(gdn_fla.importlib, "import_module", lambda name: FakeGdn)
    args = _good_args()
    gdn_fla.chunk_gated_delta_rule_fla(**args)
    (kw,) = calls
    assert "use_graph" not in kw and "chunk_offsets" not in kw
    if layout == "staged":
        assert kw["chunk_indices"].tolist() == [[0, 0], [1, 0]]  # lengths 2 and 3
    else:
        assert "chunk_indices" not in kw


# ----------------------------------------------------------------------------- GPU


def require_fla() -> None:
    """GPU runs carry fla-core (the `gpu` extra): its absence is a failure, not a skip,
    so a GPU run can never pass without testing the fla path."""
    if not gdn_fla._fla_installed():
        pytest.fail("fla-core is not installed: pip install 'kvloom[gpu]' (or carry its wheel)")


def run_both(dtype, lengths, with_state, *, use_qk_l2norm=True, scale=None, seed=0):
    require_fla()
    q, k, v, g, beta, cu, state = make_inputs(lengths, dtype, "cuda", seed=seed)
    if not use_qk_l2norm:  # unit keys keep the delta rule stable without in-kernel norm
        q, k = F.normalize(q.float(), dim=-1).to(dtype), F.normalize(k.float(), dim=-1).to(dtype)
    has = None
    if with_state:
        has = torch.arange(len(lengths), device="cuda") % 2 == 0
        state[~has] = float("nan")  # never read: a multiply by 0 would spread it
    else:
        state = None
    kwargs = dict(scale=scale, use_qk_l2norm=use_qk_l2norm)
    out, final = gdn_fla.chunk_gated_delta_rule_fla(q, k, v, g, beta, cu, state, has, **kwargs)
    ref_out, ref_final = gdn_ref.chunk_gated_delta_rule(q, k, v, g, beta, cu, state, has, **kwargs)
    return out, final, ref_out, ref_final


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_fla_matches_reference_qwen3_next_shapes(dtype, with_state):
    out, final, ref_out, ref_final = run_both(dtype, LENGTHS, with_state)
    assert out.shape == ref_out.shape == (sum(LENGTHS), HV, DV) and out.dtype == dtype
    assert final.shape == (len(LENGTHS), HV, DK, DV) and final.dtype == torch.float32
    assert out.isfinite().all() and final.isfinite().all()
    bounds = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    tol = REL_TOL[dtype]
    errs = {"out": rel_err(out, ref_out), "state": rel_err(final, ref_final)}
    # Per sequence too: a short sequence's error must not hide inside a long one's norm.
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        errs[f"out[{i}] len {b - a}"] = rel_err(out[a:b], ref_out[a:b])
        errs[f"state[{i}]"] = rel_err(final[i], ref_final[i])
    print(f"{dtype} with_state={with_state}: " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"relative error above {tol}: {bad}"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_fla_without_l2norm_and_custom_scale():
    out, final, ref_out, ref_final = run_both(
        torch.bfloat16, [70, 5], True, use_qk_l2norm=False, scale=0.25, seed=1
    )
    errs = (rel_err(out, ref_out), rel_err(final, ref_final))
    print(f"no l2norm, scale 0.25: out {errs[0]:.2e}, state {errs[1]:.2e}")
    assert max(errs) <= REL_TOL[torch.bfloat16], errs


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_fla_empty_sequence_keeps_its_state_and_zero_tokens():
    out, final, ref_out, ref_final = run_both(torch.float32, [65, 0, 3], True)
    assert torch.equal(final[1], ref_final[1])  # has_initial_state[1] is False: zeros
    assert rel_err(out, ref_out) <= 5e-3 and rel_err(final, ref_final) <= 5e-3
    # An even row with a state and no tokens hands its state back unchanged.
    out, final, _, ref_final = run_both(torch.float32, [0, 4], True)
    assert torch.equal(final[0], ref_final[0])
    q, k, v, g, beta, _, state = make_inputs([0, 0], torch.bfloat16, "cuda")
    cu = torch.zeros(3, dtype=torch.int64, device="cuda")
    has = torch.tensor([True, False], device="cuda")
    out, final = gdn_fla.chunk_gated_delta_rule_fla(q, k, v, g, beta, cu, state, has)
    assert out.shape == (0, HV, DV) and torch.equal(final[0], state[0])
    assert torch.equal(final[1], torch.zeros_like(final[1]))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_dispatcher_on_cuda(monkeypatch):
    require_fla()
    q, k, v, g, beta, cu, _ = make_inputs([65, 7], torch.bfloat16, "cuda")
    calls = []
    real = gdn_fla.chunk_gated_delta_rule_fla

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(gdn_fla, "chunk_gated_delta_rule_fla", spy)
    fla_out, _ = ops.chunk_gated_delta_rule(q, k, v, g, beta, cu, use_qk_l2norm=True)
    assert calls == [1]
    monkeypatch.setenv("KVLOOM_NO_FLA", "1")
    ref_out, _ = ops.chunk_gated_delta_rule(q, k, v, g, beta, cu, use_qk_l2norm=True)
    assert calls == [1]
    want, _ = gdn_ref.chunk_gated_delta_rule(q, k, v, g, beta, cu, use_qk_l2norm=True)
    assert torch.equal(ref_out, want)
    assert rel_err(fla_out, want) <= REL_TOL[torch.bfloat16]


@pytest.mark.gpu
def test_float32_stays_on_the_exact_reference_on_cuda(monkeypatch):
    """fla rounds float32 through TF32, so float32 prefill on CUDA is the reference's, bit
    for bit (test_kda_fla.py checks the same for KDA)."""
    require_fla()
    calls = []
    monkeypatch.setattr(gdn_fla, "chunk_gated_delta_rule_fla", lambda *a, **k: calls.append(1))
    q, k, v, g, beta, cu, _ = make_inputs([65, 7], torch.float32, "cuda")
    got, _ = ops.chunk_gated_delta_rule(q, k, v, g, beta, cu, use_qk_l2norm=True)
    want, _ = gdn_ref.chunk_gated_delta_rule(q, k, v, g, beta, cu, use_qk_l2norm=True)
    assert torch.equal(got, want) and calls == []


@pytest.mark.gpu
def test_staged_layout_gives_fla_default_bits(monkeypatch):
    """kvloom's staged chunk layout gives fla's Gated DeltaNet the chunks its own layout
    does: the same bits, with and without initial states, around the 64-token edge."""
    require_fla()
    q, k, v, g, beta, cu, state = make_inputs(LENGTHS, torch.bfloat16, "cuda")
    has = torch.arange(len(LENGTHS), device="cuda") % 2 == 0
    state[~has] = float("nan")  # never read
    runs = {}
    for choice in ("fla", "staged"):
        monkeypatch.setenv("KVLOOM_FLA_LAYOUT", choice)
        runs[choice] = gdn_fla.chunk_gated_delta_rule_fla(
            q, k, v, g, beta, cu, state, has, use_qk_l2norm=True
        )
    for default, staged in zip(runs["fla"], runs["staged"]):
        assert torch.equal(default, staged)
