"""Kimi-Linear's decoder-layer norms fused into the GEMV that reads them (norm_linear).

Per layer at decode sizes: the input norm runs in the prologue of KDA's qkv_proj GEMV or
MLA's kv_a_proj_with_mqa GEMV (the other projections read the normed rows that launch
stores); the post-attention norm in the dense MLP's gate_up GEMV, or in the unfolded shared
experts' gate_up GEMV (router and routed experts read the stored normed rows). A folded
shared expert leaves only the float32 router GEMV after the norm, which the bf16 prologue
does not feed: that norm stays its own launch.

Checked like tests/test_rms_norm_gemv.py checks Llama / Qwen3-Next: on the CPU with the
GEMV and RMSNorm dispatch forced onto the interpreted Triton kernels, a tiny bf16
Kimi-Linear's greedy decode is bitwise the same fused and unfused (tokens, logprobs, the
last layer's hidden state and residual), and the fused launch replaces exactly one norm
launch and one GEMV launch at each fused site.
"""

from __future__ import annotations

import pytest
import torch

from kvloom.kernels import gemv_triton as gt
from kvloom.kernels import rms_norm_triton as rt
from kvloom.kernels.gemv import NORM_GEMV_MAX_M
from tests.engine_helpers import record_steps
from tests.test_gemv import randn
from tests.test_oracle_kimi_linear import KIMI_Q_LORA, build_kimi
from tests.test_rms_norm_gemv import GATED, Counter, _force_decode_kernels

# norm_gemv is opt-in (contracts/envs.py OPT_IN_FUSIONS): these tests check it.
pytestmark = pytest.mark.usefixtures("norm_gemv_on")


def fused_sites(model) -> int:
    """Norm + GEMV pairs fused per one-row step: every input norm, and the post-attention
    norm where a dense MLP or unfolded shared experts follow it."""
    from kvloom.workers.models.kimi_linear import KimiMoE

    sites = 0
    for layer in model.model.layers:
        mlp = layer.mlp
        sites += 1 + (not isinstance(mlp, KimiMoE) or mlp.shared_experts is not None)
    return sites


def decode(path, monkeypatch, fuse: bool):
    """(output, final-norm inputs per step, fused calls, all norm/GEMV calls, fused sites,
    steps of at most NORM_GEMV_MAX_M rows) of a greedy bf16 decode."""
    from kvloom import LLM
    from kvloom.contracts.sampling_params import SamplingParams
    from kvloom.workers.layers.norm import RMSNorm

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5)
    with monkeypatch.context() as patch:
        _force_decode_kernels(patch, fuse)
        fused = Counter(patch, gt, "rms_norm_gemv_triton")
        launches = [fused, Counter(patch, rt, "rms_norm_triton")]
        launches += [Counter(patch, gt, name) for name in ("gemv_triton", GATED)]
        llm = LLM(str(path), dtype="bfloat16", progress=False, block_size=16, enforce_eager=True)
        model = llm.engine.executor.worker.runner.model
        for seed, module in enumerate(model.modules()):  # perturbed: mis-wiring shows
            if isinstance(module, RMSNorm):
                weight = module.weight
                weight.copy_(randn(*weight.shape, seed=seed, dtype=weight.dtype, scale=0.3) + 1)
        states, rows = [], []
        model.model.norm.register_forward_hook(
            lambda module, args, out: states.append([a.clone() for a in args])
        )
        model.model.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
        out = llm.generate([5, 17, 33, 9, 61, 7], params, use_tqdm=False)[0].outputs[0]
        small = sum(1 for n in rows if n <= NORM_GEMV_MAX_M)
        assert small >= params.max_tokens - 1
        total = sum(c.calls for c in launches)
        return out, states, fused.calls, total, fused_sites(model), small


@pytest.fixture(scope="module")
def kimi_variants(tmp_path_factory, demo_tokenizer_dir, hybrid_model):
    """The demo model (folded shared expert, q_proj), the oracle's tiny model (two unfolded
    shared experts) and its q-LoRA variant (biased MLA projections, two dense layers)."""

    def make(name):
        if name == "demo":
            return hybrid_model("kimi_linear")
        overrides = KIMI_Q_LORA if name == "q_lora" else {}
        return build_kimi(tmp_path_factory.mktemp(f"kimi-{name}"), demo_tokenizer_dir, **overrides)

    return make


@pytest.mark.parametrize("variant", ["demo", "shared_experts", "q_lora"])
def test_decode_is_bitwise_the_same_fused(monkeypatch, kimi_variants, variant):
    path = kimi_variants(variant)
    plain, plain_states, plain_calls, plain_total, _, _ = decode(path, monkeypatch, False)
    got, got_states, fused_calls, fused_total, sites, small = decode(path, monkeypatch, True)
    # The fused launch runs at each site of every small step, never at the prefill, and
    # replaces a norm launch and a GEMV launch each time.
    assert plain_calls == 0 and fused_calls == sites * small
    assert plain_total - fused_total == fused_calls
    assert len(plain_states) == len(got_states) >= 4
    for step, (want, have) in enumerate(zip(plain_states, got_states)):
        assert all(torch.equal(a, b) for a, b in zip(want, have, strict=True)), step
    assert got.token_ids == plain.token_ids
    assert got.logprobs == plain.logprobs


def test_decode_is_bitwise_the_same_with_kda_decode_fused(monkeypatch, hybrid_model):
    """KDA's fused decode step (gates + recurrence + output norm in one launch,
    ops.kda_decode_step) in a whole model: with the decode rows' 3-D tensors on the
    interpreted Triton kernels (KDA's gates, recurrence and norm; MLA's attention), the
    greedy decode is bitwise the same with the fused launch and with the three separate
    launches (KVLOOM_UNFUSED=kda_decode), and the fused launch runs once per KDA layer
    and decode step."""
    import kvloom.kernels.gated_delta_rule_triton as gdr
    from kvloom import LLM
    from kvloom.contracts.sampling_params import SamplingParams
    from kvloom.kernels import ops
    from kvloom.workers.layers.kda_layer import KimiDeltaAttention

    def decode_rows(t):
        return t.dim() == 3 and t.shape[0] <= NORM_GEMV_MAX_M

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5)
    results = {}
    for unfused in ("kda_decode", ""):
        with monkeypatch.context() as patch:
            patch.setenv("KVLOOM_UNFUSED", unfused)
            patch.setattr(
                ops, "use_triton", lambda t: t.dtype in ops.TRITON_DTYPES and decode_rows(t)
            )
            patch.setattr(
                ops, "_decode_fusion", lambda x: x.dtype != torch.float32 and decode_rows(x)
            )
            fused = Counter(patch, gdr, "kda_decode_triton")
            path = hybrid_model("kimi_linear")
            llm = LLM(
                str(path), dtype="bfloat16", progress=False, block_size=16, enforce_eager=True
            )
            model = llm.engine.executor.worker.runner.model
            states, rows = record_steps(model)
            out = llm.generate([5, 17, 33, 9, 61, 7], params, use_tqdm=False)[0].outputs[0]
            kda_layers = sum(isinstance(m, KimiDeltaAttention) for m in model.modules())
            small = sum(1 for n in rows if n <= NORM_GEMV_MAX_M)  # the decode steps
            results[unfused] = (out, states, fused.calls, kda_layers * small)
    plain, plain_states, plain_calls, _ = results["kda_decode"]
    got, got_states, fused_calls, expected_calls = results[""]
    assert plain_calls == 0 and fused_calls == expected_calls >= params.max_tokens - 1
    assert len(got_states) == len(plain_states) >= params.max_tokens
    for step, (want, have) in enumerate(zip(plain_states, got_states)):
        assert all(torch.equal(a, b) for a, b in zip(want, have, strict=True)), step
    assert got.token_ids == plain.token_ids and got.logprobs == plain.logprobs


def _router_rows_decode(path, patch, unfused: str):
    """(output, norm launches that stored widened rows, (dtype, rows) the router was
    handed each call) of a
    greedy bf16 decode with KVLOOM_UNFUSED=`unfused`, decode rows (2-D, at most 2) on the
    interpreted Triton kernels as on a GPU."""
    from kvloom import LLM
    from kvloom.contracts.sampling_params import SamplingParams
    from kvloom.kernels import ops
    from kvloom.workers.models.kimi_linear import KimiRouter

    patch.setenv("KVLOOM_UNFUSED", unfused)
    patch.setattr(
        ops, "use_triton", lambda t: t.dtype == torch.bfloat16 and t.dim() == 2 and t.shape[0] <= 2
    )
    widened, handed = [], []
    norm, route = rt.rms_norm_triton, KimiRouter.forward

    def counted_norm(*args, **kwargs):
        widened.append(kwargs.get("out_float32") is not None)
        return norm(*args, **kwargs)

    patch.setattr(rt, "rms_norm_triton", counted_norm)
    patch.setattr(
        KimiRouter, "forward", lambda self, h: handed.append((h.dtype, len(h))) or route(self, h)
    )
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5)
    llm = LLM(str(path), dtype="bfloat16", progress=False, enforce_eager=True)
    out = llm.generate([5, 17, 33, 9, 61, 7], params, use_tqdm=False)[0].outputs[0]
    return out, sum(widened), handed


def test_router_rows_come_from_the_norm_launch(monkeypatch, hybrid_model):
    """Kimi-Linear with its shared expert folded: the post-attention norm's launch also
    stores its rows widened for the float32 router (ops.rms_norm_widened), so no cast
    launch runs between them; the decode is bitwise the same as with
    KVLOOM_UNFUSED=router_rows (the norm, then a cast)."""
    path = hybrid_model("kimi_linear")  # the demo model: a folded shared expert
    with monkeypatch.context() as patch:
        plain, plain_widened, plain_handed = _router_rows_decode(path, patch, "router_rows")
    with monkeypatch.context() as patch:
        fused, fused_widened, fused_handed = _router_rows_decode(path, patch, "")
    # The router gets float32 rows either way (its own .to() is then a no-op); with the
    # fusion the decode steps' rows were stored by the norm's launch, without it none.
    assert {dtype for dtype, _ in plain_handed + fused_handed} == {torch.float32}
    decode_calls = sum(1 for _, rows in fused_handed if rows <= 2)
    assert plain_widened == 0 and fused_widened == decode_calls >= 3
    assert fused.token_ids == plain.token_ids and fused.logprobs == plain.logprobs
