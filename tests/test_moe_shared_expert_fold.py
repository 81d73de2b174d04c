"""A shared expert folded into the fused MoE as expert E (issue 23): Qwen3-Next /
Qwen3.5-MoE (weight sigmoid(shared gate logit)) and Kimi-Linear (weight 1).

* Layers: the folded layer equals the two-branch layer on the same checkpoint tensors, on
  the CPU: float64 and bfloat16 within the rounding bound below; and the CUDA path's
  kernels (router + fused MoE, interpreted Triton) against the two-branch composition.
* Loading: expert E of `experts` holds the checkpoint's `shared_expert(s).*` tensors (each
  rank's intermediate slice at TP = 2, as the two-branch layer's shared expert holds them),
  no other module holds them; in Qwen3.5-MoE's multimodal layout and the MTP head too.
* The choice: unequal widths, quantized experts or shared expert, and separate gates keep
  two branches; the constructor refuses a fold it cannot do.
* Whole models: the folded Qwen3-Next against transformers (float32, the oracle tolerance)
  and against its own two-branch build (float64, 1e-10); TP = 2 equals TP = 1 (float64);
  an int4 checkpoint (two branches) equals its dequantized float twin (folded).
* `gpu`: Qwen3-Next's shape (hidden 2048, 512 experts, top-10, intermediate 512, bf16)
  compiled, folded against two branches and a float64 reference; CUDA-graph replay.

The rounding bound. Per output element, with u the unit roundoff of the dtype (2^-8 for
bfloat16, 2^-53 for float64) and g = (H + I) * u_acc a dot product's accumulation bound
(u_acc = 2^-24 for float32 accumulation, 2^-53 for float64), the two paths differ by at
most

    u * (2|out| + |routed| + 2|gate * shared|) + (4u + g) * A

The first term is the roundings of the two-branch path that the fold does not make (the
routed sum, the shared expert's output and its product with the gate, the final sum; each
path's final rounding once); A = sum over a token's routes of |w| (|W2| @ (|silu(gate) *
up| + |gate * up|)) bounds what rounding the activation (and, on the two-branch path, its
gate and up before it) can move the output by (d/dgate of silu(gate) * up is within
1.1 |up|). The measured differences are printed (ERRNORM).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file
from torch import nn

from kvloom import LLM
from kvloom.kernels.activation import gated_add_ref, silu_and_mul_ref
from kvloom.workers.layers.moe import FusedMoE, map_expert_weight, map_shared_expert_weight
from kvloom.workers.layers.quantization.config import parse_quantization_config
from kvloom.workers.layers.tp_group import LocalGroup
from kvloom.workers.models import qwen3_next
from kvloom.workers.models.kimi_linear import STACKED_PARAMS as KIMI_STACKED
from kvloom.workers.models.kimi_linear import KimiLinearForCausalLM, KimiMoE
from kvloom.workers.models.qwen3_5 import Qwen3_5MoeForCausalLM
from kvloom.workers.models.qwen3_next import STACKED_PARAMS as QWEN_STACKED
from kvloom.workers.models.qwen3_next import (
    Qwen3NextDecoderLayer,
    Qwen3NextForCausalLM,
    Qwen3NextSparseMoe,
)
from kvloom.workers.weight_loader import load_weights
from tests.engine_helpers import PROMPTS
from tests.kernel_env import DEVICE, gpu, needs_cuda
from tests.oracle_helpers import kvloom_prompt_logits
from tests.quant_checkpoints import write_dequantized, write_quantized
from tests.test_oracle_qwen3_next import LOGIT_TOL, TINY_QWEN3_NEXT, save_tiny
from tests.test_qwen3_next_gate_fusion import RankOf, load, moe_layers

H, E, K, INTER = 64, 8, 2, 32
QWEN = dict(
    hidden_size=H,
    num_experts=E,
    num_experts_per_tok=K,
    moe_intermediate_size=INTER,
    shared_expert_intermediate_size=INTER,
    norm_topk_prob=True,
)
KIMI = dict(
    hidden_size=H,
    num_experts=E,
    num_experts_per_token=K,
    moe_intermediate_size=INTER,
    num_shared_experts=1,
    routed_scaling_factor=2.446,
)
SHARED_NAME = {"qwen3_next": "shared_expert", "kimi": "shared_experts"}
PROJS = ("gate_proj", "up_proj", "down_proj")
FOLDED_QWEN3_NEXT = {**TINY_QWEN3_NEXT, "shared_expert_intermediate_size": 32}
PROMPT = [5, 17, 42, 99, 3, 250, 77, 12, 300, 8, 64, 128]


# ------------------------------------------------------------------------- the layers


def layer_tensors(kind: str, seed: int, hidden: int = H, experts: int = E, inter: int = INTER):
    """One MoE layer's checkpoint tensors under `mlp.` (float32, the released names)."""
    gen = torch.Generator().manual_seed(seed)

    def w(rows, cols, scale=1.0):
        return torch.randn(rows, cols, generator=gen) * scale / cols**0.5

    out = {"mlp.gate.weight": w(experts, hidden, 2.0)}
    names = ("gate_proj", "up_proj", "down_proj") if kind == "qwen3_next" else ("w1", "w3", "w2")
    for e in range(experts):
        out[f"mlp.experts.{e}.{names[0]}.weight"] = w(inter, hidden, 2.0)
        out[f"mlp.experts.{e}.{names[1]}.weight"] = w(inter, hidden, 2.0)
        out[f"mlp.experts.{e}.{names[2]}.weight"] = w(hidden, inter)
    shared = f"mlp.{SHARED_NAME[kind]}"
    out[f"{shared}.gate_proj.weight"] = w(inter, hidden, 2.0)
    out[f"{shared}.up_proj.weight"] = w(inter, hidden, 2.0)
    out[f"{shared}.down_proj.weight"] = w(hidden, inter)
    if kind == "qwen3_next":
        out["mlp.shared_expert_gate.weight"] = w(1, hidden, 3.0)
    else:
        out["mlp.gate.e_score_correction_bias"] = torch.randn(experts, generator=gen) * 0.1
    return out


class Holder(nn.Module):
    """Holds a layer under `mlp` and maps names as the models do."""

    def __init__(self, mlp: nn.Module, kind: str):
        super().__init__()
        self.mlp = mlp
        self.shared_name = SHARED_NAME[kind]

    def map_weight_name(self, name: str):
        return map_expert_weight(name) or map_shared_expert_weight(self, name, self.shared_name)


def build_layer(kind: str, fold: bool, dtype, tensors: dict, tp=None) -> nn.Module:
    tp = tp or LocalGroup()
    if kind == "qwen3_next":
        mlp = Qwen3NextSparseMoe(QWEN, tp, dtype, fuse_gates=True, fold_shared_expert=fold)
    else:
        mlp = KimiMoE(KIMI, tp, dtype, fold_shared_experts=fold)
    stacked = QWEN_STACKED if kind == "qwen3_next" else KIMI_STACKED
    load_weights(Holder(mlp, kind), tensors.items(), stacked)
    return mlp.eval()


def unit_roundoff(dtype) -> tuple[float, float]:
    """(u of the dtype, u of its accumulation)."""
    if dtype == torch.float64:
        return 2.0**-53, 2.0**-53
    return {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}[dtype], 2.0**-24


def activation_magnitude(x, w13, w2, weights, ids) -> torch.Tensor:
    """A of the module docstring, in float64."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    inter = w13.shape[1] // 2
    total = torch.zeros_like(x)
    for slot in range(ids.shape[1]):
        for expert in ids[:, slot].unique().tolist():
            rows = ids[:, slot] == expert
            gate_up = x[rows] @ w13[expert].T
            gate, up = gate_up[:, :inter], gate_up[:, inter:]
            act = (F.silu(gate) * up).abs() + (gate * up).abs()
            total[rows] += weights[rows, slot, None].double().abs() * (act @ w2[expert].abs().T)
    return total


def rounding_bound(dtype, out, routed, gated_shared, magnitude, inner: int) -> torch.Tensor:
    u, u_acc = unit_roundoff(dtype)
    terms = 2 * out.double().abs() + routed.double().abs() + 2 * gated_shared.double().abs()
    return u * terms + (4 * u + inner * u_acc) * magnitude


def report(name, diff, bound, out):
    ratio = (diff / bound.clamp_min(1e-300)).max().item()
    print(
        f"ERRNORM {name}: max |fold - two branches| {diff.max().item():.3g} "
        f"(max |out| {out.abs().max().item():.3g}), worst fraction of the bound {ratio:.3g}"
    )
    assert (diff <= bound).all(), f"{name}: beyond the rounding bound ({ratio:.3g}x)"


def two_branch_parts(kind, layer, x):
    """(routed, gate * shared, routes) of a two-branch layer, each rounded as it does."""
    with torch.no_grad():
        if kind == "qwen3_next":
            logits, gate = layer.gate(x).split([E, 1], dim=-1)
            weights, ids = qwen3_next.route_softmax_topk(logits, K, True)
            shared = gated_add_ref(torch.zeros_like(x), gate, layer.shared_expert(x))
        else:
            weights, ids = layer.gate(x)
            shared = layer.shared_experts(x)
        return layer.experts(x, weights, ids), shared, (weights, ids)


def folded_routes(kind, layer, x):
    with torch.no_grad():
        if kind == "qwen3_next":
            return qwen3_next.route_softmax_topk(layer.gate(x), K, True, "sigmoid_last_logit")
        return layer.gate(x)


@pytest.mark.parametrize("kind", ["qwen3_next", "kimi"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_folded_layer_equals_two_branches(kind, dtype, tokens):
    tensors = layer_tensors(kind, seed=tokens)
    folded = build_layer(kind, True, dtype, tensors)
    branches = build_layer(kind, False, dtype, tensors)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(7)).to(dtype)
    with torch.no_grad():
        out_fold, out_two = folded(x), branches(x)
    routed, gated_shared, (weights, ids) = two_branch_parts(kind, branches, x)
    # The same routes, then the shared expert, id E (the folded weights' last slot).
    fold_w, fold_ids = folded_routes(kind, folded, x)
    assert torch.equal(fold_ids[:, :K], ids) and (fold_ids[:, K] == E).all()
    assert torch.equal(fold_w[:, :K], weights)
    # The shared branch is not negligible: leaving it out would fail the bound.
    assert (out_two - routed).abs().max() > 0.1 * out_two.abs().max()
    magnitude = activation_magnitude(x, folded.experts.w13, folded.experts.w2, fold_w, fold_ids)
    bound = rounding_bound(dtype, out_two, routed, gated_shared, magnitude, H + INTER)
    report(
        f"{kind} {dtype} T{tokens}", (out_fold.double() - out_two.double()).abs(), bound, out_two
    )


def test_kernel_path_interpreted_equals_two_branch_kernels():
    """The CUDA path's calls on the interpreter: softmax router with the shared route plus
    the fused MoE over E + 1 experts, against the two-branch composition (router, fused MoE
    over E, the shared expert rounded as a half-precision GatedMLP rounds, gated_add)."""
    from kvloom.kernels.fused_moe_triton import fused_moe_triton
    from kvloom.kernels.moe_router_triton import softmax_topk_triton

    tensors = layer_tensors("qwen3_next", seed=11)
    for dtype in (torch.bfloat16, torch.float32):
        folded = build_layer("qwen3_next", True, dtype, tensors)
        branches = build_layer("qwen3_next", False, dtype, tensors)
        x = torch.randn(6, H, generator=torch.Generator().manual_seed(12)).to(DEVICE, dtype)
        w13, w2 = folded.experts.w13.to(DEVICE), folded.experts.w2.to(DEVICE)
        with torch.no_grad():
            logits = folded.gate.weight.to(DEVICE) @ x.T
            logits = logits.T.contiguous()  # [T, E + 1]: the fused gate GEMM's output
            weights, ids = softmax_topk_triton(logits, K, True, "sigmoid_last_logit")
            out_fold = fused_moe_triton(x, w13, w2, weights, ids)
            plain_w, plain_ids = softmax_topk_triton(logits[:, :E], K, True)
            routed = fused_moe_triton(x, w13[:E], w2[:E], plain_w, plain_ids)
            mlp = branches.shared_expert
            shared = F.linear(silu_and_mul_ref(F.linear(x, mlp.gate_up_proj.weight)), w2[E])
            out_two = gated_add_ref(routed, logits[:, E:], shared)
        assert torch.equal(ids[:, :K], plain_ids) and (ids[:, K] == E).all()
        gated_shared = torch.sigmoid(logits[:, E:]) * shared
        magnitude = activation_magnitude(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
        bound = rounding_bound(
            dtype, out_two.cpu(), routed.cpu(), gated_shared.cpu(), magnitude, H + INTER
        )
        diff = (out_fold.double() - out_two.double()).abs().cpu()
        report(f"interpreted kernels {dtype}", diff, bound, out_two.cpu())


def test_constructor_refuses_a_fold_it_cannot_do():
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        Qwen3NextSparseMoe(
            {**QWEN, "shared_expert_intermediate_size": 48}, LocalGroup(), torch.float32, True, True
        )
    with pytest.raises(ValueError, match="fused gates"):
        Qwen3NextSparseMoe(QWEN, LocalGroup(), torch.float32, False, True)
    with pytest.raises(ValueError, match="exactly one shared expert"):
        KimiMoE({**KIMI, "num_shared_experts": 2}, LocalGroup(), torch.float32, True)


# --------------------------------------------------------------------------- loading


def layer_params(mlp) -> set[str]:
    return {name for name, _ in mlp.named_parameters()}


def assert_expert_e_holds(experts: FusedMoE, gate, up, down, rank=0, world=1):
    """Expert E of the stacks: rank `rank`'s slice of the shared expert's intermediate dim
    (gate rows, up rows; down columns), as its column/row-parallel linears split it."""
    rows = slice(rank * gate.shape[0] // world, (rank + 1) * gate.shape[0] // world)
    assert experts.shared_expert_id == experts.num_experts == experts.w13.shape[0] - 1
    want13 = torch.cat([gate[rows], up[rows]]).to(experts.w13.dtype)
    torch.testing.assert_close(experts.w13[-1], want13, rtol=0, atol=0)
    torch.testing.assert_close(experts.w2[-1], down[:, rows].to(experts.w2.dtype), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["qwen3_next", "kimi"])
def test_layer_loads_the_shared_expert_into_expert_e(kind):
    """At TP = 1 and on each of two ranks, expert E is the shared expert's slice the
    two-branch layer's shared expert holds on that rank, and no other parameter holds it."""
    tensors = layer_tensors(kind, seed=3)
    shared = [tensors[f"mlp.{SHARED_NAME[kind]}.{p}.weight"] for p in PROJS]
    for world in (1, 2):
        for rank in range(world):
            tp = RankOf(rank, world) if world > 1 else None
            folded = build_layer(kind, True, torch.float32, tensors, tp)
            assert_expert_e_holds(folded.experts, *shared, rank, world)
            two = build_layer(kind, False, torch.float32, tensors, tp)
            mlp = two.shared_expert if kind == "qwen3_next" else two.shared_experts
            torch.testing.assert_close(folded.experts.w13[-1], mlp.gate_up_proj.weight)
            torch.testing.assert_close(folded.experts.w2[-1], mlp.down_proj.weight)
            torch.testing.assert_close(folded.experts.w13[:-1], two.experts.w13)
            params = {"gate.weight", "experts.gate_up.weight", "experts.down.weight"}
            if kind == "kimi":
                params.add("gate.e_score_correction_bias")
            assert layer_params(folded) == params


def test_shared_expert_name_maps_only_where_folded():
    tensors = layer_tensors("qwen3_next", 4)
    folded = Holder(build_layer("qwen3_next", True, torch.float32, tensors), "qwen3_next")
    two = Holder(build_layer("qwen3_next", False, torch.float32, tensors), "qwen3_next")

    def mapped(holder, name, shared_name="shared_expert"):
        return map_shared_expert_weight(holder, name, shared_name)

    scale = "mlp.shared_expert.up_proj.weight_scale"  # any parameter, quantized ones too
    assert mapped(folded, scale) == ("mlp.experts.gate_up", "weight_scale", 2 * E + 1)
    down = "mlp.shared_expert.down_proj.weight"
    assert mapped(folded, down) == ("mlp.experts.down", "weight", E)
    assert mapped(two, scale) is None  # the layer keeps its shared expert apart
    assert mapped(folded, scale, "shared_experts") is None  # another model's spelling
    assert mapped(folded, "mlp.shared_expert_gate.weight") is None
    assert mapped(folded, "nope.shared_expert.up_proj.weight") is None  # no such layer


@pytest.fixture(scope="module")
def folded_src(tmp_path_factory, demo_tokenizer_dir) -> Path:
    return save_tiny(
        tmp_path_factory.mktemp("qwen3-next-fold"), demo_tokenizer_dir, FOLDED_QWEN3_NEXT
    )


def test_checkpoint_loads_into_expert_e(folded_src):
    tensors = load_file(str(folded_src / "model.safetensors"))
    for world in (1, 2):
        for rank in range(world):
            model = load(
                Qwen3NextForCausalLM, folded_src, RankOf(rank, world) if world > 1 else None
            )
            layers = moe_layers(model)
            assert sorted(layers) == [0, 1, 3]
            for index, mlp in layers.items():
                assert mlp.folded_shared_expert and "shared_expert" not in dict(
                    mlp.named_children()
                )
                name = f"model.layers.{index}.mlp.shared_expert"
                parts = [tensors[f"{name}.{p}.weight"] for p in PROJS]
                assert_expert_e_holds(mlp.experts, *parts, rank, world)


def test_unequal_widths_keep_two_branches(tmp_path, demo_tokenizer_dir):
    path = save_tiny(tmp_path, demo_tokenizer_dir, TINY_QWEN3_NEXT)  # 32 vs 48
    for mlp in moe_layers(load(Qwen3NextForCausalLM, path)).values():
        assert not mlp.folded_shared_expert and mlp.experts.w13.shape[0] == E
        assert mlp.experts.shared_expert_id is None
        assert mlp.shared_expert.gate_up_proj.weight.shape == (96, 64)


def test_qwen3_5_moe_multimodal_checkpoint_folds(tmp_path, demo_tokenizer_dir, monkeypatch):
    from tests import test_oracle_qwen3_5_layouts as layouts

    moe = {**layouts.MOE, "shared_expert_intermediate_size": layouts.MOE["moe_intermediate_size"]}
    monkeypatch.setitem(layouts.KINDS, "moe", (*layouts.KINDS["moe"][:2], moe))
    hf = layouts.build("moe", tmp_path, demo_tokenizer_dir)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    model = load(Qwen3_5MoeForCausalLM, tmp_path)
    layers = moe_layers(model)
    assert len(layers) == len(model.model.layers)
    for index, mlp in layers.items():
        name = f"model.language_model.layers.{index}.mlp.shared_expert"
        assert_expert_e_holds(mlp.experts, *[tensors[f"{name}.{p}.weight"] for p in PROJS])
    ours = kvloom_prompt_logits(
        LLM(str(tmp_path), dtype="float32", progress=False, block_size=16), PROMPT
    )
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([PROMPT])).logits[0]
    err = (ours - ref).abs().max().item()
    print(f"ERRNORM qwen3.5-moe folded vs transformers: {err:.3g}")
    assert err <= LOGIT_TOL


def test_mtp_head_folds_and_loads(folded_src, tmp_path):
    from kvloom.workers.spec_decode.mtp import (
        MtpHead,
        MtpWeights,
        iterate_mtp_tensors,
        write_mtp_checkpoint,
    )

    write_mtp_checkpoint(folded_src, tmp_path, seed=5)
    tensors = load_file(str(tmp_path / "mtp.safetensors"))
    head = MtpHead(FOLDED_QWEN3_NEXT, Qwen3NextDecoderLayer, 1, LocalGroup(), torch.float32)
    load_weights(
        MtpWeights(head), iterate_mtp_tensors([tmp_path / "mtp.safetensors"]), QWEN_STACKED
    )
    mlp = head.layers[0].mlp
    assert mlp.folded_shared_expert
    name = "mtp.layers.0.mlp.shared_expert"
    assert_expert_e_holds(mlp.experts, *[tensors[f"{name}.{p}.weight"] for p in PROJS])


def test_kimi_checkpoint_folds_one_shared_expert(tmp_path, demo_tokenizer_dir):
    from tests.test_oracle_kimi_linear import build_kimi

    path = build_kimi(tmp_path / "one", demo_tokenizer_dir, n_shared_experts=1)
    tensors = load_file(str(path / "model.safetensors"))
    for world in (1, 2):
        for rank in range(world):
            model = load(KimiLinearForCausalLM, path, RankOf(rank, world) if world > 1 else None)
            moes = {
                i: layer.mlp
                for i, layer in enumerate(model.model.layers)
                if isinstance(layer.mlp, KimiMoE)
            }
            assert sorted(moes) == [1, 2, 3]
            for index, mlp in moes.items():
                assert mlp.shared_experts is None and mlp.gate.shared_expert_weight == "one"
                name = f"model.layers.{index}.block_sparse_moe.shared_experts"
                parts = [tensors[f"{name}.{p}.weight"] for p in PROJS]
                assert_expert_e_holds(mlp.experts, *parts, rank, world)
    two = build_kimi(tmp_path / "two", demo_tokenizer_dir)  # n_shared_experts=2: kept apart
    for layer in load(KimiLinearForCausalLM, two).model.layers[1:]:
        assert layer.mlp.shared_experts is not None and layer.mlp.experts.shared_expert_id is None


# ------------------------------------------------------------------------- the choice


def int4_checkpoint(src: Path, out: Path, quantize: str) -> tuple[Path, Path]:
    """W4A16 g32 on the routed experts or on the shared expert only -> (int4, dequantized)."""
    pattern = re.compile(rf"\.mlp\.{quantize}\.(\d+\.)?(gate|up|down)_proj\.weight$")

    def config(cfg):
        cfg["config_groups"]["group_0"]["targets"] = [rf"re:.*\.mlp\.{quantize}\..*"]
        return cfg

    q = write_quantized(src, out / "q", "w4a16_g32", config_edit=config, pattern=pattern)
    return q, write_dequantized(src, out / "d", "w4a16_g32", pattern=pattern)


@pytest.mark.parametrize("quantize", ["experts", "shared_expert"])
def test_quantized_layers_keep_two_branches(folded_src, tmp_path, quantize):
    """Either branch int4: two branches (today's path); its dequantized float twin folds;
    both give the same logits (float activations: float32 rounding apart)."""
    quantized, dequantized = int4_checkpoint(folded_src, tmp_path, quantize)
    for mlp in moe_layers(load(Qwen3NextForCausalLM, quantized)).values():
        assert not mlp.folded_shared_expert and mlp.experts.shared_expert_id is None
        module = mlp.experts.gate_up if quantize == "experts" else mlp.shared_expert.gate_up_proj
        assert module.quant_method is not None
    for mlp in moe_layers(load(Qwen3NextForCausalLM, dequantized)).values():
        assert mlp.folded_shared_expert
    ours = kvloom_prompt_logits(LLM(str(quantized), dtype="float32", progress=False), PROMPT)
    ref = kvloom_prompt_logits(LLM(str(dequantized), dtype="float32", progress=False), PROMPT)
    err = (ours - ref).abs().max().item()
    print(f"ERRNORM int4 {quantize} (two branches) vs dequantized (folded): {err:.3g}")
    assert err <= 1e-5


def test_separate_gates_keep_two_branches():
    config = FOLDED_QWEN3_NEXT
    layer = Qwen3NextDecoderLayer(config, 0, "linear_attention", LocalGroup(), torch.float32)
    assert layer.mlp.folded_shared_expert  # float, equal widths, gates fused
    qconfig = parse_quantization_config(
        {
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["gate", "experts", "shared_expert", "lm_head"],
        }
    )
    # The shared expert gate quantized, the router not: two gate modules, so no fold.
    assert not qwen3_next.gate_fusion(qconfig, 0)
    layer = Qwen3NextDecoderLayer(
        config, 0, "linear_attention", LocalGroup(), torch.float32, qconfig
    )
    assert not layer.mlp.folded_shared_expert and not layer.mlp.fused_gates
    assert qwen3_next.shared_expert_folding(config, qconfig, 0)  # only the gates stop it


# ---------------------------------------------------------------------- whole models


def test_folded_model_matches_transformers(folded_src):
    """The oracle's prompts (up to 50 tokens). This random checkpoint's float32 logits drift
    further on a 70-token prompt, by 6.6e-4 for the folded and the two-branch builds alike
    (seen: the same figure to every digit), which the float64 test below covers."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folded_src, dtype=torch.float32).eval()
    llm = LLM(str(folded_src), dtype="float32", progress=False, block_size=16)
    model = llm.engine.executor.worker.runner.model
    assert all(mlp.folded_shared_expert for mlp in moe_layers(model).values())
    for prompt in PROMPTS:
        ours = kvloom_prompt_logits(llm, prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert ref.abs().max() > 1.0
        err = (ours - ref).abs().max().item()
        print(f"ERRNORM folded qwen3-next vs transformers ({len(prompt)} tokens): {err:.3g}")
        assert err <= LOGIT_TOL


def test_fold_and_two_branches_agree_in_float64(folded_src, monkeypatch):
    """The same checkpoint built both ways (the choice forced off): float64 logits agree."""
    prompt = list(range(3, 60))
    folded = kvloom_prompt_logits(LLM(str(folded_src), dtype="float64", progress=False), prompt)
    monkeypatch.setattr(qwen3_next, "shared_expert_folding", lambda *args: False)
    llm = LLM(str(folded_src), dtype="float64", progress=False)
    model = llm.engine.executor.worker.runner.model
    assert not any(mlp.folded_shared_expert for mlp in moe_layers(model).values())
    two = kvloom_prompt_logits(llm, prompt)
    err = (folded - two).abs().max().item()
    print(f"ERRNORM float64 folded vs two branches: {err:.3g}")
    assert err <= 1e-10


def test_tensor_parallel_two_ranks_match_one_folded(folded_src):
    """tests/test_oracle_qwen3_next.py's float64 TP = 2 check on the folded checkpoint."""
    import threading

    from tests.test_oracle_qwen3_next import ThreadTPGroup, load_rank, run_steps

    reference = run_steps(load_rank(folded_src, None))
    shared = {"slots": [None, None], "barrier": threading.Barrier(2, timeout=60)}
    ranks = [load_rank(folded_src, ThreadTPGroup(r, 2, shared)) for r in range(2)]
    assert ranks[1].model.layers[0].mlp.experts.w2.shape == (E + 1, 64, 16)
    results: list = [None, None]

    def work(r):
        results[r] = run_steps(ranks[r])

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for rank_logits in results:
        for ours, ref in zip(rank_logits, reference, strict=True):
            torch.testing.assert_close(ours, ref, rtol=0, atol=1e-10)


# ------------------------------------------------------------------------------- gpu


GPU_SHAPE = dict(hidden=2048, experts=512, top_k=10, inter=512)  # Qwen3-Next-80B's MoE


@pytest.fixture(scope="module")
def gpu_layers():
    """{fold: layer} at GPU_SHAPE in bf16 on the GPU, loaded from the same tensors."""
    hidden, experts, top_k, inter = GPU_SHAPE.values()
    config = dict(
        hidden_size=hidden,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        shared_expert_intermediate_size=inter,
    )
    tensors = layer_tensors("qwen3_next", seed=8, hidden=hidden, experts=experts, inter=inter)
    layers = {}
    for fold in (True, False):
        with torch.device("cuda"):
            mlp = Qwen3NextSparseMoe(config, LocalGroup(), torch.bfloat16, True, fold)
        load_weights(Holder(mlp, "qwen3_next"), tensors.items(), QWEN_STACKED)
        layers[fold] = mlp.eval()
    return layers


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 8, 256])
def test_gpu_qwen3_next_shape_folded_equals_two_branches(tokens, gpu_layers):
    """hidden 2048, 512 experts, top-10, intermediate 512 (shared 512), bf16, compiled:
    the folded layer against the two-branch layer (the bound above) and against float64
    (rounds once: u|out| + the activation's rounding), then replayed from a CUDA graph."""
    from kvloom.kernels.fused_moe import fused_moe_ref

    hidden, experts, top_k, inter = GPU_SHAPE.values()
    layers = gpu_layers
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(9))
    x = x.to("cuda", torch.bfloat16)
    with torch.no_grad():
        out_fold, out_two = layers[True](x), layers[False](x)
        logits = layers[True].gate(x)
        weights, ids = qwen3_next.route_softmax_topk(logits, top_k, True, "sigmoid_last_logit")
        plain_w, plain_ids = qwen3_next.route_softmax_topk(logits[:, :experts], top_k, True)
        routed = layers[False].experts(x, plain_w, plain_ids)
        shared = layers[False].shared_expert(x)
    assert torch.equal(ids[:, :top_k], plain_ids) and (ids[:, top_k] == experts).all()
    gated_shared = torch.sigmoid(logits[:, experts:]) * shared
    w13, w2 = layers[True].experts.w13, layers[True].experts.w2
    magnitude = activation_magnitude(x, w13, w2, weights, ids).cpu()
    out_two = out_two.cpu()
    bound = rounding_bound(
        torch.bfloat16, out_two, routed.cpu(), gated_shared.cpu(), magnitude, hidden + inter
    )
    diff = (out_fold.double().cpu() - out_two.double()).abs()
    report(f"gpu T{tokens} fold vs two branches", diff, bound, out_two)
    # Against float64 on the same bf16 weights and routes (no rounding anywhere): the fold
    # rounds the output once (u|out|) and the activation once (within u A), and
    # accumulates in float32.
    exact = fused_moe_ref(x.double(), w13.double(), w2.double(), weights.double(), ids).cpu()
    u = 2.0**-8
    fold_bound = u * exact.abs() + (2 * u + (hidden + inter) * 2.0**-24) * magnitude
    err = (out_fold.double().cpu() - exact).abs()
    two_err = (out_two.double() - exact).abs().max().item()
    print(
        f"ERRNORM gpu T{tokens}: max |fold - f64| {err.max().item():.3g}, "
        f"max |two branches - f64| {two_err:.3g}"
    )
    assert (err <= fold_bound).all()

    graph = torch.cuda.CUDAGraph()
    static_x = x.clone()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_out = layers[True](static_x)
    static_x.copy_(torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(10)))
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        assert torch.equal(static_out, layers[True](static_x))
