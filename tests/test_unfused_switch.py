"""KVLOOM_UNFUSED (contracts/envs.py): each decode fusion named there falls back to the
separate launches it replaces, for A/B timing in one GPU lease and as an escape hatch.
The fused and separate kernels are stubbed: this tests the choice, not the kernels (their
own tests compare the bits)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kvloom.kernels.activation_triton as act_triton
import kvloom.kernels.gated_delta_rule_triton as gdn_triton
import kvloom.kernels.gemv_triton as gemv_triton
import kvloom.kernels.qk_norm_rope_triton as rope_triton
from kvloom.contracts import envs
from kvloom.kernels import fused_moe_triton, ops

# norm_gemv is opt-in (contracts/envs.py OPT_IN_FUSIONS): these tests check it.
pytestmark = pytest.mark.usefixtures("norm_gemv_on")


BF16 = torch.bfloat16


def test_names_are_checked_and_all_means_every_fusion(monkeypatch):
    monkeypatch.delenv("KVLOOM_UNFUSED", raising=False)
    monkeypatch.setenv("KVLOOM_FUSED", "all")  # the opt-in ones on too
    assert not any(envs.unfused(name) for name in envs.FUSIONS)
    monkeypatch.setenv("KVLOOM_UNFUSED", " norm_gemv, moe_pairs ")
    assert [envs.unfused(name) for name in envs.FUSIONS] == [
        name in ("norm_gemv", "moe_pairs") for name in envs.FUSIONS
    ]
    monkeypatch.setenv("KVLOOM_UNFUSED", "all")
    assert all(envs.unfused(name) for name in envs.FUSIONS)
    monkeypatch.setenv("KVLOOM_UNFUSED", "norm_gemv,kv_wirte")
    with pytest.raises(ValueError, match="KVLOOM_UNFUSED.*kv_wirte"):
        envs.unfused("norm_gemv")
    with pytest.raises(KeyError, match="not a fusion"):
        envs.unfused("nothing")


def test_the_opt_in_fusions_are_off_unless_named_and_unfused_wins(monkeypatch):
    """An H200 measured the norm + GEMV launch slower than its two launches, an H100 PDL
    slower than none and the in-launch split merge level: off unless KVLOOM_FUSED names
    them; KVLOOM_UNFUSED beats KVLOOM_FUSED; names are checked."""
    monkeypatch.delenv("KVLOOM_UNFUSED", raising=False)
    monkeypatch.delenv("KVLOOM_FUSED", raising=False)
    opt_in = ("norm_gemv", "pdl", "split_merge")
    assert opt_in == envs.OPT_IN_FUSIONS
    assert [envs.unfused(name) for name in envs.FUSIONS] == [
        name in opt_in for name in envs.FUSIONS
    ]
    monkeypatch.setenv("KVLOOM_FUSED", "norm_gemv")
    assert [envs.unfused(name) for name in envs.FUSIONS] == [
        name in ("pdl", "split_merge") for name in envs.FUSIONS
    ]
    monkeypatch.setenv("KVLOOM_FUSED", "pdl, norm_gemv, split_merge")
    assert not any(envs.unfused(name) for name in envs.FUSIONS)
    monkeypatch.setenv("KVLOOM_FUSED", "all")
    assert not any(envs.unfused(name) for name in envs.FUSIONS)
    monkeypatch.setenv("KVLOOM_UNFUSED", "norm_gemv")
    assert envs.unfused("norm_gemv") and not envs.unfused("kv_write")
    monkeypatch.delenv("KVLOOM_UNFUSED")
    monkeypatch.setenv("KVLOOM_FUSED", "norm_gemm")
    with pytest.raises(ValueError, match="KVLOOM_FUSED.*norm_gemm"):
        envs.unfused("norm_gemv")


class Calls:
    """Stubs module functions, recording which ran."""

    def __init__(self, monkeypatch):
        self.ran: list[str] = []
        self.patch = monkeypatch

    def stub(self, module, name, result):
        def run(*args, **kwargs):
            self.ran.append(name)
            return result(*args) if callable(result) else result

        self.patch.setattr(module, name, run)


def norm_gemv(calls):
    x, w = torch.ones(1, 64, dtype=BF16), torch.ones(32, 64, dtype=BF16)
    calls.stub(gemv_triton, "rms_norm_gemv_triton", (torch.ones(1, 32, dtype=BF16), x, None))
    calls.stub(ops, "rms_norm", (x, x))
    calls.stub(ops, "linear", torch.ones(1, 32, dtype=BF16))
    ops.rms_norm_linear(x, x.clone(), torch.ones(64, dtype=BF16), 1e-6, w)
    return "rms_norm_gemv_triton", ["rms_norm", "linear"]


def kv_write(calls):
    q, k = torch.ones(1, 2, 8, dtype=BF16), torch.ones(1, 1, 8, dtype=BF16)
    cache = torch.zeros(4, 4, 2, 1, 8, dtype=BF16)
    calls.stub(rope_triton, "qk_norm_rope_kv_write_triton", (q, k))
    calls.stub(ops, "qk_norm_rope", (q, k))
    table = torch.ones(16, 4)
    positions, slots = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    ops.qk_norm_rope_try_kv_write(
        q, k, k, positions, table, table, None, None, 1e-6, 8, 0.0, cache, slots
    )
    return "qk_norm_rope_kv_write_triton", ["qk_norm_rope"]


def mul_sigmoid(calls):
    x, gate = torch.ones(1, 16, dtype=BF16), torch.ones(1, 2, 8, dtype=BF16)
    calls.stub(act_triton, "mul_sigmoid_triton", x)
    calls.stub(ops, "mul_sigmoid_ref", x)
    ops.mul_sigmoid(x, gate)
    return "mul_sigmoid_triton", ["mul_sigmoid_ref"]


def gdn_decode(calls):
    q = torch.ones(1, 2, 8, dtype=BF16)
    state = torch.zeros(2, 2, 8, 8)
    calls.stub(gdn_triton, "gdn_decode_triton", q)
    calls.stub(ops, "gdn_gates", (None, None))
    calls.stub(ops, "recurrent_gated_delta_rule", q)
    calls.stub(ops, "gated_rms_norm", q)
    ba = torch.ones(1, 4, dtype=BF16)
    ops.gdn_decode_step(
        q, q, q, ba, torch.ones(2), torch.ones(2), 1, state, torch.zeros(1), q, q, 1e-6
    )
    return "gdn_decode_triton", ["gdn_gates", "recurrent_gated_delta_rule", "gated_rms_norm"]


def moe_pairs(calls):
    hidden = SimpleNamespace(shape=(1, 64), dtype=BF16, is_cuda=True)
    block = fused_moe_triton.PAIRS_BLOCK_M
    calls.ran.append("pairs" if fused_moe_triton.uses_pairs_plan(hidden, block) else "sorted")
    return "pairs", ["sorted"]


def kda_norm(calls):
    import kvloom.kernels.kda_gated_norm_triton as kda_norm_triton

    x = torch.ones(1, 2, 8, dtype=BF16)
    calls.stub(kda_norm_triton, "kda_gated_norm_triton", x)
    calls.stub(ops, "kda_gated_norm_ref", x)
    ops.kda_gated_norm(x, x, torch.ones(8, dtype=BF16), 1e-6)
    return "kda_gated_norm_triton", ["kda_gated_norm_ref"]


def gdn_conv(calls):
    x, w, conv_w = torch.ones(1, 64, dtype=BF16), torch.ones(48, 64), torch.ones(32, 4)
    w, conv_w = w.to(BF16), conv_w.to(BF16)
    y, conv = torch.ones(1, 48, dtype=BF16), torch.ones(1, 32, dtype=BF16)
    # The norm's launch (or not: norm_gemv) is not this switch's business.
    calls.patch.setattr(ops, "_takes_norm_gemv", lambda *args: False)
    calls.patch.setattr(ops, "rms_norm", lambda *args: (x, x))
    calls.stub(gemv_triton, "gemv_conv_triton", (y, conv))
    calls.stub(ops, "rms_norm_linear", (y, x, None))
    calls.stub(ops, "causal_conv1d_update", conv)
    pool, slots = torch.zeros(2, 32, 3), torch.zeros(1, dtype=torch.int32)
    ops.rms_norm_linear_conv(x, x, torch.ones(64, dtype=BF16), 1e-6, w, None, conv_w, pool, slots)
    return "gemv_conv_triton", ["rms_norm_linear", "causal_conv1d_update"]


@pytest.mark.parametrize(
    "fusion", [norm_gemv, kv_write, mul_sigmoid, gdn_decode, moe_pairs, kda_norm, gdn_conv]
)
@pytest.mark.parametrize("switch", ["", "name", "all", "others"])
def test_each_fusion_falls_back_when_named(monkeypatch, fusion, switch):
    """The fused launch runs unless KVLOOM_UNFUSED names it (or says all); naming the
    other fusions leaves it on."""
    name = fusion.__name__
    others = ",".join(n for n in envs.FUSIONS if n != name)
    value = {"": "", "name": name, "all": "all", "others": others}[switch]
    monkeypatch.setenv("KVLOOM_UNFUSED", value)
    monkeypatch.setattr(ops, "use_triton", lambda t: True)  # the CUDA choices, on CPU
    calls = Calls(monkeypatch)
    fused, separate = fusion(calls)
    assert calls.ran == (separate if switch in ("name", "all") else [fused])


def test_every_variable_is_documented_for_users():
    """contracts/envs.py says docs/configuration.md lists its variables: keep it so."""
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    assert [name for name in envs.VARIABLES if f"`{name}" not in doc] == []
