"""Gated DeltaNet reads x with one GEMM and no cat (issue 23): Qwen3-Next's released
in_proj_qkvz (rows interleaved per key head: [q, k, v, z] of head 0, of head 1, ...) and
in_proj_ba load as one linear `in_proj` whose rows on each rank are
[q | k | v | z] of its key heads, then its heads' [b, a] rows as released; Qwen3.5's four
projections as [q | k | v | z | b | a]. A quantized checkpoint keeps the released linears.
Logits against transformers (TP = 1 and 2): tests/test_oracle_qwen3_next.py and
tests/test_oracle_qwen3_5.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from kvloom.kernels.gated_delta_rule_triton import fuses_norm
from kvloom.workers.layers import gated_deltanet as gdn_module
from kvloom.workers.layers.gated_deltanet import GatedDeltaNet
from kvloom.workers.models import qwen3_next as qwen3_next_module
from kvloom.workers.models.qwen3_5 import Qwen3_5ForCausalLM
from kvloom.workers.models.qwen3_next import Qwen3NextForCausalLM
from tests.quant_checkpoints import write_quantized
from tests.test_oracle_qwen3_5 import TINY_QWEN3_5
from tests.test_oracle_qwen3_next import (
    TINY_QWEN3_NEXT,
    TP_STEPS,
    forward_batch,
    load_rank,
    save_tiny,
)
from tests.test_qwen3_next_gate_fusion import load, ranks

# norm_gemv is opt-in (contracts/envs.py OPT_IN_FUSIONS): these tests check it.
pytestmark = pytest.mark.usefixtures("norm_gemv_on")


CFG = TINY_QWEN3_NEXT
HK, HV = CFG["linear_num_key_heads"], CFG["linear_num_value_heads"]
DK, DV, R = CFG["linear_key_head_dim"], CFG["linear_value_head_dim"], HV // HK


@pytest.fixture(scope="module")
def src(tmp_path_factory, demo_tokenizer_dir) -> Path:
    return save_tiny(tmp_path_factory.mktemp("qwen3-next-gdn"), demo_tokenizer_dir, CFG)


def gdn_layers(model) -> dict[int, GatedDeltaNet]:
    layers = enumerate(model.model.layers)
    return {i: layer.linear_attn for i, layer in layers if layer.kind == "linear_attention"}


def expected_rows(qkvz: torch.Tensor, ba: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's rows, head by head from the released layout: every key head's q, then
    every k, v and z; then the rank's heads' [b, a] rows untouched."""
    heads = range(rank * HK // world, (rank + 1) * HK // world)
    per_head = qkvz.view(HK, 2 * DK + 2 * R * DV, -1)
    sizes = [DK, DK, R * DV, R * DV]
    parts = [[per_head[h].split(sizes)[p] for h in heads] for p in range(4)]
    ba_rows = ba.view(HK, 2 * R, -1)[heads.start : heads.stop].flatten(0, 1)
    return torch.cat([torch.cat(p) for p in parts] + [ba_rows])


def test_fused_projection_holds_regrouped_rows(src):
    tensors = load_file(str(src / "model.safetensors"))
    for tp in ranks():
        rank, world = (0, 1) if tp is None else (tp.rank, tp.world_size)
        for index, gdn in gdn_layers(load(Qwen3NextForCausalLM, src, tp)).items():
            assert gdn.fused and not hasattr(gdn, "in_proj_qkvz") and not hasattr(gdn, "in_proj_ba")
            name = f"model.layers.{index}.linear_attn"
            want = expected_rows(
                tensors[f"{name}.in_proj_qkvz.weight"], tensors[f"{name}.in_proj_ba.weight"],
                rank, world,
            )  # fmt: skip
            torch.testing.assert_close(gdn.in_proj.weight, want, rtol=0, atol=0)
            # The conv's channels are the first columns: this rank's [q | k | v].
            assert gdn.conv_channels == (2 * HK * DK + HV * DV) // world


def test_qwen3_5_fused_projection_holds_its_four_parts(tmp_path):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3_5TextConfig(**TINY_QWEN3_5), dtype=torch.float32
    )
    hf.save_pretrained(tmp_path)
    path = tmp_path
    tensors = load_file(str(path / "model.safetensors"))
    hk, hv = TINY_QWEN3_5["linear_num_key_heads"], TINY_QWEN3_5["linear_num_value_heads"]
    dk, dv = TINY_QWEN3_5["linear_key_head_dim"], TINY_QWEN3_5["linear_value_head_dim"]
    for tp in ranks():
        rank, world = (0, 1) if tp is None else (tp.rank, tp.world_size)
        for index, gdn in gdn_layers(load(Qwen3_5ForCausalLM, path, tp)).items():
            name = f"model.layers.{index}.linear_attn"
            qkv = tensors[f"{name}.in_proj_qkv.weight"].split([hk * dk, hk * dk, hv * dv])
            parts = [*qkv] + [tensors[f"{name}.in_proj_{p}.weight"] for p in ("z", "b", "a")]
            want = torch.cat([p.chunk(world)[rank] for p in parts])
            torch.testing.assert_close(gdn.in_proj.weight, want, rtol=0, atol=0)
            assert gdn.ba_group == hv // world


# Kernels the layer calls through kernels.ops: one launch each on CUDA (their CPU
# references run many torch ops, which are not the layer's launches); gdn_decode_step is
# one where a program holds a whole value head (`fuses_norm`, checked below).
KERNELS = (
    "gdn_gates",
    "causal_conv1d_update",
    "recurrent_gated_delta_rule",
    "gated_rms_norm",
    "gdn_decode_step",
    "rms_norm_linear_conv",
    "norm_linear",
)
# Ops that only make views (no launch).
VIEWS = {
    "view",
    "reshape",
    "split",
    "split_with_sizes",
    "slice",
    "t",
    "_unsafe_view",
    "unflatten",
    "flatten",
}


class LaunchRecorder(TorchDispatchMode):
    """Records the torch ops a forward dispatches, each kernel above as one entry."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.inside_kernel = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside_kernel:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def kernel(self, name, fn):
        def run(*args, **kwargs):
            self.ops.append(name)
            self.inside_kernel = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside_kernel = False

        return run


def decode_launches(model_dir, monkeypatch, decoder_layer=False) -> dict[int, list[str]]:
    """Each GDN layer's launches (ops that are not views) in a decode-only step: the
    layer called alone, or (`decoder_layer`) its decoder layer, norms and MLP included."""
    model = load_rank(model_dir, None)
    with torch.inference_mode():
        for rows in TP_STEPS[:-1]:
            ids, batch = forward_batch(model, rows)
            model(ids, batch.positions, batch)
        ids, batch = forward_batch(model, TP_STEPS[-1])
        # Every row resumes its state with one token: the runner's decode-only batch.
        assert all(n == 1 for n in batch.rows.num_scheduled_tokens)
        assert all(batch.rows.has_initial_state)
        batch.decode_only = True
        launches = {}
        for index, gdn in gdn_layers(model).items():
            hidden = torch.randn(ids.shape[0], CFG["hidden_size"], dtype=torch.float64)
            residual = torch.randn_like(hidden)
            recorder = LaunchRecorder()
            with monkeypatch.context() as patch:
                for name in KERNELS:
                    kernel = recorder.kernel(name, getattr(gdn_module, name))
                    patch.setattr(gdn_module, name, kernel)
                norm_linear = recorder.kernel("norm_linear", qwen3_next_module.norm_linear)
                patch.setattr(qwen3_next_module, "norm_linear", norm_linear)
                with recorder:
                    if decoder_layer:
                        model.model.layers[index](batch.positions, hidden, residual, batch)
                    else:
                        gdn(hidden, batch)
            launches[index] = [op for op in recorder.ops if op not in VIEWS]
    return launches


def test_decode_step_runs_one_projection_gemm_and_no_cat(src, monkeypatch):
    """A decode-only step: each GDN layer is four launches: in_proj, conv update, the
    fused gates + recurrence + gated norm, out_proj (before: six, the gates, recurrence
    and norm separate; before that, in_proj_qkvz, cat and in_proj_ba in place of
    in_proj)."""
    for ops in decode_launches(src, monkeypatch).values():
        assert ops == ["linear", "causal_conv1d_update", "gdn_decode_step", "linear"], ops
    # The Triton plan holds a whole value head (so the norm is in the same launch) at this
    # config's head dims; Qwen3-Next's 128 x 128 heads take narrow tiles, the norm separate.
    assert fuses_norm(DK, DV) and not fuses_norm(128, 128)


def test_decoder_layer_decode_step_folds_the_conv_into_the_projection(src, monkeypatch):
    """In the decoder layer, a decode-only GDN step is three launches: the input norm, in_proj
    and conv update as one op (ops.rms_norm_linear_conv: one launch on CUDA, its dispatch
    tested in tests/test_gdn_conv_epilogue.py), the fused gates + recurrence + gated norm,
    out_proj; then the post-attention norm with the MLP's first projection."""
    for ops in decode_launches(src, monkeypatch, decoder_layer=True).values():
        assert ops[:4] == ["rms_norm_linear_conv", "gdn_decode_step", "linear", "norm_linear"], ops


def test_quantized_projections_stay_separate(src, tmp_path):
    """in_proj_qkvz quantized, in_proj_ba float (as Qwen's FP8 release): two schemes, so
    the released linears stay two modules (and the cat stays)."""
    path = write_quantized(src, tmp_path / "q", "fp8_channel")
    for tp in ranks():
        for gdn in gdn_layers(load(Qwen3NextForCausalLM, path, tp)).values():
            assert not gdn.fused and not hasattr(gdn, "in_proj")
            assert gdn.in_proj_qkvz.quant_method is not None
            assert gdn.in_proj_ba.quant_method is None
