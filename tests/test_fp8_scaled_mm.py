"""cuBLAS's blockwise FP8 GEMM in the serving path (kernels/fp8_gemm_dispatch.py), on the CPU:

* which calls `scaled_mm_blocker` lets through, each condition flipped in turn;
* what `ops.fp8_linear` then runs: cuBLAS (a fake `torch._scaled_mm` that enforces the
  operand and scale layouts torch's `_scaled_mm` checks for 1x128 / 128x128 scaling and
  computes the blockwise product in float64), the Triton GEMM (a spy) in the
  deterministic mode, with KVLOOM_SCALED_MM=0 and after a refusal, which is
  remembered for the shape and logged once; the result against `fp8_linear_ref`;
* the block scale an FP8 layer keeps (`Fp8Method.block_scale`) against the checkpoint's
  own [N / 128, K / 128] tensor, on tensor-parallel ranks (fused QKV with and without
  replicated KV heads, row-parallel) and its absence where a shard or part splits a block.

No Triton is imported here: the Triton entry points are replaced by fakes in sys.modules
(the quantizer by the reference, which the Triton one matches bitwise). The compiled
path against the reference is tests/triton_interpret/test_fp8_scaled_mm_triton.py.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from kvloom.kernels import dispatch, fp8_gemm_dispatch, ops
from kvloom.kernels.fp8_gemm import fp8_linear_ref
from kvloom.kernels.fp8_quant import FP8_DTYPE, per_token_group_quant_fp8_ref
from kvloom.workers.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from kvloom.workers.layers.quantization import (
    deferred_weights,
    parse_quantization_config,
    quantize_model,
)
from tests.quant_checkpoints import quantization_config, quantize_weight

TRITON = "kvloom.kernels.fp8_gemm_triton"


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def block_weight(n, k, seed):
    """e4m3 weight [n, k], its float32 block scale [n / 128, k / 128] and the per-row
    scale the loader expands it to [n, k / 128]."""
    w_q = (torch.randn(n, k, generator=gen(seed)) * 40).to(FP8_DTYPE)
    blocks = torch.rand(n // 128, k // 128, generator=gen(seed + 1)) * 0.02 + 1e-3
    return w_q, blocks, blocks.repeat_interleave(128, dim=0)


class FakeCublas:
    """torch._scaled_mm for 1x128 activation and 128x128 weight scales: checks what
    torch's `_scaled_mm` checks for that recipe (aten/src/ATen/native/cuda/ScaledBlas.cpp:
    row-major mat1, column-major mat2, scale_a [M, K/128] with strides (1, M), scale_b.t()
    [N/128, K/128] with strides (K/128, 1); a stride of a size-1 dimension is free), then
    computes the product in float64. Like cuBLAS on the H200, it refuses a row count that
    is not a multiple of 4 (the column-major scales' 16-byte alignment); `refuse`: refuse
    every shape."""

    def __init__(self, refuse: bool = False):
        self.refuse = refuse
        self.calls = []

    def __call__(self, a, b, scale_a, scale_b, bias=None, out_dtype=None):
        self.calls.append((a.shape, scale_b))
        if self.refuse:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `...`")
        (m, k), n = a.shape, b.shape[1]
        if m % 4:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED (unaligned scales)")
        kb, nb = k // 128, n // 128
        assert a.dtype == b.dtype == FP8_DTYPE and bias is None
        assert a.stride(1) == 1 and b.stride(0) == 1, "mat1 row-major, mat2 column-major"

        def laid_out(t, size, stride):
            return tuple(t.shape) == size and all(
                sz <= 1 or st == want for sz, st, want in zip(size, t.stride(), stride)
            )

        assert scale_a.dtype == scale_b.dtype == torch.float32
        assert laid_out(scale_a, (m, kb), (1, m)), (scale_a.shape, scale_a.stride())
        assert laid_out(scale_b.t(), (nb, kb), (kb, 1)), (scale_b.shape, scale_b.stride())
        out = torch.zeros(m, n, dtype=torch.float64)
        w_scale = scale_b.double().repeat_interleave(128, dim=1)  # [K/128, N]
        for g in range(kb):
            cols = slice(g * 128, (g + 1) * 128)
            part = a[:, cols].double() @ b[cols].double()
            out += part * scale_a[:, g, None].double() * w_scale[g][None, :]
        return out.to(out_dtype)


@pytest.fixture
def fakes(monkeypatch):
    """A Hopper 'GPU': Triton on (its entry points faked), capability 9.0, a fake cuBLAS;
    refusals forgotten. Returns (cublas, calls to the Triton GEMM / GEMV)."""
    triton_calls = []

    def quant(x, group, column_major_scales=False):
        x_q, x_s = per_token_group_quant_fp8_ref(x, group)
        return x_q, x_s.t().contiguous().t() if column_major_scales else x_s

    def gemm(x, w_q, w_s, group, bias=None, out_dtype=None):
        triton_calls.append("gemm")
        return fp8_linear_ref(x, w_q, w_s, group, None, bias, out_dtype)

    def gemv(*args, **kwargs):
        triton_calls.append("gemv")
        return "gemv"

    fake_gemm = types.ModuleType(TRITON)
    fake_gemm.per_token_group_quant_fp8_triton = quant
    fake_gemm.fp8_linear_triton = gemm
    fake_gemv = types.ModuleType("kvloom.kernels.quant_gemv_triton")
    fake_gemv.fp8_gemv_triton = gemv
    monkeypatch.setitem(sys.modules, TRITON, fake_gemm)
    monkeypatch.setitem(sys.modules, "kvloom.kernels.quant_gemv_triton", fake_gemv)
    monkeypatch.setattr(ops, "use_triton", lambda t: True)
    monkeypatch.setattr(fp8_gemm_dispatch, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(fp8_gemm_dispatch, "_refused", set())
    monkeypatch.setattr(fp8_gemm_dispatch, "_logged", set())
    monkeypatch.setenv("KVLOOM_SCALED_MM", "1")
    cublas = FakeCublas()
    monkeypatch.setattr(torch, "_scaled_mm", cublas)
    return cublas, triton_calls


@pytest.fixture
def deterministic_mode():
    before = dispatch.batch_invariant()
    dispatch.set_batch_invariant(True)
    yield
    dispatch.set_batch_invariant(before)


# -------------------------------------------------------------------- the selection


N, K = 256, 512  # the smallest eligible weight: 2 x 4 blocks (K / 128 a multiple of 4)


def eligible_call():
    w_q, blocks, _ = block_weight(N, K, 0)
    return {
        "x": torch.randn(64, K, generator=gen(2)).bfloat16(),
        "w_q": w_q,
        "group_size": 128,
        "block_scale": blocks,
        "out_dtype": None,
    }


def test_an_eligible_call_is_let_through(fakes):
    assert fp8_gemm_dispatch.scaled_mm_blocker(**eligible_call()) is None
    call = eligible_call()
    call["x"] = call["x"].view(4, 16, K)  # leading dims count as tokens
    assert fp8_gemm_dispatch.scaled_mm_blocker(**call) is None
    call["out_dtype"] = torch.float32
    assert fp8_gemm_dispatch.scaled_mm_blocker(**call) is None


def _not_contiguous(w):
    return w.t().contiguous().t()


# Each mutation of the eligible call, and a word of the reason it must give.
FLIPS = {
    "tokens below the threshold": (lambda c: c.update(x=c["x"][:63]), "below"),
    "no block scale": (lambda c: c.update(block_scale=None), "no 128x128"),
    "N not a multiple of 128": (
        lambda c: c.update(w_q=c["w_q"][:192], block_scale=c["block_scale"][:1]),
        "multiple",
    ),
    "K / 128 not a multiple of 4": (
        lambda c: c.update(
            x=c["x"][:, :384],
            w_q=c["w_q"][:, :384].contiguous(),
            block_scale=c["block_scale"][:, :3],
        ),
        "multiple",
    ),
    "64-column groups": (lambda c: c.update(group_size=64), "blocks"),
    "a block scale of another shape": (
        lambda c: c.update(block_scale=c["block_scale"].repeat_interleave(2, dim=0)),
        "blocks",
    ),
    "a transposed block scale": (
        lambda c: c.update(block_scale=_not_contiguous(c["block_scale"])),
        "contiguous",
    ),
    "a float64 block scale": (lambda c: c.update(block_scale=c["block_scale"].double()), "float32"),
    "a weight that is not contiguous": (
        lambda c: c.update(w_q=_not_contiguous(c["w_q"])),
        "weight",
    ),
    "float16 output": (lambda c: c.update(out_dtype=torch.float16), "dtype"),
}


@pytest.mark.parametrize("flip", list(FLIPS))
def test_each_condition_alone_keeps_the_triton_gemm(fakes, flip):
    mutate, word = FLIPS[flip]
    call = eligible_call()
    mutate(call)
    reason = fp8_gemm_dispatch.scaled_mm_blocker(**call)
    assert reason is not None and word in reason, (flip, reason)


@pytest.mark.parametrize("capability", [None, (8, 9), (10, 0), (9, 1)])
def test_only_compute_capability_9_0_takes_cublas(fakes, monkeypatch, capability):
    monkeypatch.setattr(fp8_gemm_dispatch, "device_capability", lambda device: capability)
    assert "compute capability 9.0" in fp8_gemm_dispatch.scaled_mm_blocker(**eligible_call())


def test_a_cpu_tensor_has_no_capability():
    assert fp8_gemm_dispatch.device_capability(torch.device("cpu")) is None


def test_the_deterministic_mode_and_the_switch_keep_the_triton_gemm(fakes, monkeypatch):
    call = eligible_call()
    before = dispatch.batch_invariant()
    dispatch.set_batch_invariant(True)
    try:
        assert "deterministic" in fp8_gemm_dispatch.scaled_mm_blocker(**call)
    finally:
        dispatch.set_batch_invariant(before)
    assert fp8_gemm_dispatch.scaled_mm_blocker(**call) is None
    monkeypatch.setenv("KVLOOM_SCALED_MM", "0")
    assert "KVLOOM_SCALED_MM=0" in fp8_gemm_dispatch.scaled_mm_blocker(**call)
    monkeypatch.delenv("KVLOOM_SCALED_MM")
    assert fp8_gemm_dispatch.scaled_mm_blocker(**call) is None  # on by default
    monkeypatch.setenv("KVLOOM_SCALED_MM", "1")
    assert fp8_gemm_dispatch.scaled_mm_blocker(**call) is None


# -------------------------------------------------------------------- ops.fp8_linear


def run_linear(tokens, out_dtype=None, bias=False, seed=0):
    w_q, blocks, w_s = block_weight(N, K, seed)
    x = torch.randn(tokens, K, generator=gen(seed + 5)) * 3
    b = torch.randn(N, generator=gen(seed + 6)) if bias else None
    out = ops.fp8_linear(x, w_q, w_s, 128, None, b, out_dtype, block_scale=blocks)
    return out, fp8_linear_ref(x, w_q, w_s, 128, None, b, out_dtype)


@pytest.mark.parametrize(("tokens", "bias"), [(64, False), (65, True), (130, False), (67, False)])
def test_prefill_sizes_take_cublas_with_the_reference_semantics(fakes, tokens, bias):
    cublas, triton_calls = fakes
    out, ref = run_linear(tokens, torch.float32, bias)
    assert len(cublas.calls) == 1 and not triton_calls
    assert cublas.calls[0][0][0] == tokens + (-tokens % 4)  # rows padded for cuBLAS
    assert out.dtype == torch.float32 and out.shape == ref.shape
    # float64 against float32 sums of the same products: summation order only.
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_a_bfloat16_output_is_rounded_once(fakes):
    cublas, _ = fakes
    w_q, blocks, w_s = block_weight(N, K, 3)
    x = (torch.randn(96, K, generator=gen(4)) * 3).bfloat16()
    bias = torch.randn(N, generator=gen(5)).bfloat16()
    out = ops.fp8_linear(x, w_q, w_s, 128, None, bias, block_scale=blocks)
    ref = fp8_linear_ref(x, w_q, w_s, 128, None, bias, torch.float32)
    assert len(cublas.calls) == 1 and out.dtype == torch.bfloat16
    # Rounding the float32 result once to bfloat16: at most half an ulp, 2^-9 relative
    # to the value, plus the float32 summation order.
    err = (out.float() - ref).abs()
    assert (err <= ref.abs() * 2**-8 + 1e-5 * ref.abs().max()).all()


def test_decode_sizes_keep_the_gemv_and_the_triton_gemm(fakes):
    cublas, triton_calls = fakes
    w_q, blocks, w_s = block_weight(N, K, 0)
    for tokens, path in ((8, "gemv"), (9, "gemm"), (63, "gemm")):
        x = torch.randn(tokens, K, generator=gen(tokens))
        ops.fp8_linear(x, w_q, w_s, 128, block_scale=blocks)
        assert triton_calls[-1] == path
    assert not cublas.calls


def test_without_a_block_scale_the_triton_gemm_runs(fakes):
    cublas, triton_calls = fakes
    w_q, _, w_s = block_weight(N, K, 0)
    ops.fp8_linear(torch.randn(100, K), w_q, w_s, 128)
    assert triton_calls == ["gemm"] and not cublas.calls


def test_the_deterministic_mode_runs_the_triton_gemm(fakes, deterministic_mode):
    cublas, triton_calls = fakes
    run_linear(128)
    assert triton_calls == ["gemm"] and not cublas.calls


def test_the_switch_runs_the_triton_gemm(fakes, monkeypatch):
    cublas, triton_calls = fakes
    monkeypatch.setenv("KVLOOM_SCALED_MM", "0")
    run_linear(128)
    assert triton_calls == ["gemm"] and not cublas.calls


def test_a_refused_shape_falls_back_is_remembered_and_logged_once(fakes, caplog):
    cublas, triton_calls = fakes
    cublas.refuse = True
    with caplog.at_level(logging.WARNING, logger=fp8_gemm_dispatch.__name__):
        out, ref = run_linear(70, torch.float32)
        assert len(cublas.calls) == 1 and triton_calls == ["gemm"]
        assert torch.equal(out, ref)  # the fake Triton GEMM is the reference
        run_linear(70, torch.float32)  # the same shape: straight to the Triton GEMM
        assert len(cublas.calls) == 1 and triton_calls == ["gemm", "gemm"]
        run_linear(80, torch.float32)  # another token count is tried, not logged again
        assert len(cublas.calls) == 2 and triton_calls == ["gemm"] * 3
    warnings = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(warnings) == 1 and "CUBLAS_STATUS_NOT_SUPPORTED" in warnings[0].getMessage()
    cublas.refuse = False
    run_linear(90, torch.float32)  # shapes never refused still take cuBLAS
    assert len(cublas.calls) == 3 and triton_calls == ["gemm"] * 3


# -------------------------------------------------------------------- the loader


class Rank:
    """Rank `rank` of `world_size`, for layer geometry (no collective is called)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size


def quantized(make_layer, names):
    with deferred_weights():
        layer = make_layer()
    cfg = parse_quantization_config(quantization_config("fp8_block"))
    quantize_model(layer, cfg, {"": names}, torch.device("cpu"))
    return layer


def checkpoint(rows, cols, seed):
    """The checkpoint's tensors of one [rows, cols] projection (block scale bfloat16)."""
    w = torch.randn(rows, cols, generator=gen(seed)) / cols**0.5
    tensors, _ = quantize_weight(w, "fp8_block")
    return tensors


def load(layer, parts):
    for shard, tensors in enumerate(parts):
        for name, tensor in tensors.items():
            layer.load_shard(name, tensor, shard)


QKV_NAMES = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]


@pytest.mark.parametrize(("rank", "world"), [(0, 1), (0, 2), (1, 2), (0, 4), (3, 4)])
def test_fused_qkv_keeps_its_ranks_checkpoint_blocks(rank, world):
    """4 query heads and 2 KV heads of 128: at TP=4 each KV head is on two ranks."""
    layer = quantized(lambda: QKVParallelLinear(256, 128, 4, 2, tp=Rank(rank, world)), QKV_NAMES)
    parts = [checkpoint(512, 256, 1), checkpoint(256, 256, 2), checkpoint(256, 256, 3)]
    load(layer, parts)
    q, k, v = (p["weight_scale_inv"].float() for p in parts)
    q_rows = 4 // world  # query block rows per rank (a head is one block row)
    kv = [0, 1] if world == 1 else [rank // (world // 2)]  # TP=4: heads 0, 0, 1, 1
    expected = torch.cat([q[rank * q_rows : (rank + 1) * q_rows], k[kv], v[kv]])
    got = layer.quant_method.block_scale(layer)
    assert got.dtype == torch.float32 and got.is_contiguous()
    assert torch.equal(got, expected)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_row_parallel_rank_keeps_its_column_blocks(rank):
    layer = quantized(
        lambda: RowParallelLinear(1024, 256, tp=Rank(rank, 2)), ["model.layers.0.mlp.down_proj"]
    )
    tensors = checkpoint(256, 1024, 4)
    load(layer, [tensors])
    expected = tensors["weight_scale_inv"].float()[:, rank * 4 : (rank + 1) * 4]
    assert torch.equal(layer.quant_method.block_scale(layer), expected)


@pytest.mark.parametrize(
    ("make_layer", "parts"),
    [
        (lambda: ColumnParallelLinear(256, [192, 64]), [(192, 256), (64, 256)]),
        (lambda: ColumnParallelLinear(256, [256], tp=Rank(1, 4)), [(256, 256)]),
    ],
    ids=["a part of 192 rows", "a shard of 64 rows"],
)
def test_a_split_block_leaves_no_block_scale(make_layer, parts):
    layer = quantized(make_layer, ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"])
    load(layer, [checkpoint(r, c, i) for i, (r, c) in enumerate(parts)])
    assert not layer.quant_method.whole_blocks
    assert layer.quant_method.block_scale(layer) is None


def test_the_block_scale_is_derived_once_and_again_after_a_load():
    layer = quantized(lambda: ColumnParallelLinear(256, [256]), ["model.layers.0.mlp.gate_proj"])
    first, second = checkpoint(256, 256, 5), checkpoint(256, 256, 6)
    load(layer, [first])
    got = layer.quant_method.block_scale(layer)
    assert torch.equal(got, first["weight_scale_inv"].float())
    assert layer.quant_method.block_scale(layer) is got  # cached
    load(layer, [second])
    assert torch.equal(layer.quant_method.block_scale(layer), second["weight_scale_inv"].float())


def test_a_layer_passes_its_block_scale_to_cublas(fakes):
    """A quantized layer's forward at a prefill size hands cuBLAS the checkpoint's blocks
    (and gives the reference's result); dummy weights (scale filled in place, no load)
    get theirs from the filled scale."""
    cublas, triton_calls = fakes
    layer = quantized(lambda: ColumnParallelLinear(512, [256]), ["model.layers.0.mlp.gate_proj"])
    tensors = checkpoint(256, 512, 7)
    load(layer, [tensors])
    x = torch.randn(64, 512, generator=gen(8))
    out = layer(x)
    (_, scale_b), *_ = cublas.calls
    assert torch.equal(scale_b.t(), tensors["weight_scale_inv"].float())
    ref = fp8_linear_ref(x, layer.weight, layer.weight_scale_inv, 128)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max() and not triton_calls

    dummy = quantized(lambda: ColumnParallelLinear(512, [256]), ["model.layers.0.mlp.gate_proj"])
    dummy.weight.data.copy_(tensors["weight"])
    dummy.weight_scale_inv.data.fill_(0.02)
    dummy(x)
    assert torch.equal(cublas.calls[-1][1], torch.full((4, 2), 0.02))
