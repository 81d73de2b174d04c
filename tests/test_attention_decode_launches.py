"""The launches of one full-attention layer in a decode step (batch 1), with ops taking its
CUDA paths on CPU tensors (the Triton kernels interpreted): the q/k norm + rotary kernel
writes the paged cache itself, so PagedAttention's write launch is gone (Qwen3 / Llama:
one launch fewer per layer), and Qwen3-Next's output gate is one launch instead of a copy
of the strided gate, a sigmoid and a multiply (two more fewer). The fused layer's output
and cache are bitwise the unfused layer's (ops._decode_fusion forced off).

Paged attention itself is the torch reference here (its launch count does not change);
KVLOOM_NO_GEMV=1 keeps the projections on F.linear. On CPU without the patch, the layers
run the torch references exactly as before (tests/test_oracle_*.py).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvloom.kernels.activation_triton as act_mod
import kvloom.kernels.kv_cache_write_triton as write_mod
import kvloom.kernels.qk_norm_rope_triton as rope_mod
from kvloom.kernels import ops
from kvloom.kernels.paged_attention import paged_attention_ref
from kvloom.workers.attention_metadata import GroupMetadata
from kvloom.workers.layers import attention as attention_mod
from kvloom.workers.layers.tp_group import LocalGroup
from kvloom.workers.models.llama import LlamaAttention
from kvloom.workers.models.qwen3_next import Qwen3NextAttention
from tests import kernel_env  # noqa: F401  (the interpreter then rounds bf16 as the GPU)

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the Triton kernels interpreted on CPU tensors",
)

BLOCK_SIZE = 4
CONFIG = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    max_position_embeddings=64,
    rope_theta=10000.0,
)
# (model, Triton entry points wrapped as one launch each)
KERNELS = [
    (rope_mod, "qk_norm_rope_kv_write_triton"),
    (rope_mod, "qk_norm_rope_triton"),
    (write_mod, "write_kv_cache_triton"),
    (act_mod, "mul_sigmoid_triton"),
]
# Ops that only make views (a reshape of the strided gate copies, so it is not one), and
# `to` of a tensor already in that dtype.
NO_LAUNCH = {"view", "split", "split_with_sizes", "slice", "t", "_unsafe_view", "flatten", "to"}


class LaunchRecorder(TorchDispatchMode):
    """Records the torch ops a forward dispatches, each wrapped kernel as one entry."""

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


def reference_attention(q, kv_cache, block_tables, query_start_loc, seq_lens, scale,
                        sliding_window=None, kv_stride=1, kv_offset=0, max_query_len=None,
                        k_scale=1.0, v_scale=1.0, split_decode=None):  # fmt: skip
    return paged_attention_ref(q, kv_cache, block_tables, query_start_loc, seq_lens, scale,
                               sliding_window, kv_stride, kv_offset, k_scale, v_scale)  # fmt: skip


def build(model: str) -> torch.nn.Module:
    torch.manual_seed(0)
    tp, dtype = LocalGroup(), torch.bfloat16
    if model == "qwen3_next":
        layer = Qwen3NextAttention(dict(CONFIG, partial_rotary_factor=0.25), 0, tp, dtype)
    else:
        config = dict(CONFIG, model_type="llama" if model == "llama" else "qwen3")
        layer = LlamaAttention(config, 0, tp, dtype, qk_norm=model == "qwen3")
    with torch.no_grad():
        for name, param in layer.named_parameters():
            # Norm weights near 1 (w) or near 0 ((1 + w)); projections random.
            base = 1.0 if name.endswith("norm.weight") and model != "qwen3_next" else 0.0
            param.copy_(torch.randn(param.shape) * (0.2 if "norm" in name else 0.3) + base)
    return layer


def decode_batch(seq_len: int):
    """A one-row decode step at position seq_len - 1, its blocks 2, 0, 3, ..."""
    blocks = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32)
    pos = seq_len - 1
    slot = int(blocks[0, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE
    group = GroupMetadata(block_tables=blocks, slot_mapping=torch.tensor([slot]))
    batch = SimpleNamespace(
        positions=torch.tensor([pos]),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        decode_only=True,
        split_decode=None,
    )
    batch.group_for = lambda index: group
    return batch


def decode_launches(model, monkeypatch, fused: bool):
    """(launches, output, cache) of one decode step over a cache holding 6 earlier tokens."""
    layer = build(model)
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 4, BLOCK_SIZE, 2, 32, generator=gen).to(torch.bfloat16)
    layer.attn.kv_cache = cache
    hidden = torch.randn(1, CONFIG["hidden_size"], generator=gen).to(torch.bfloat16)
    batch = decode_batch(seq_len=7)
    recorder = LaunchRecorder()
    with monkeypatch.context() as patch:
        patch.setenv("KVLOOM_NO_GEMV", "1")
        patch.setattr(ops, "use_triton", lambda t: t.dtype in ops.TRITON_DTYPES)
        if not fused:
            patch.setattr(ops, "_decode_fusion", lambda x: False)
        for mod, name in KERNELS:
            patch.setattr(mod, name, recorder.kernel(name, getattr(mod, name)))
        attention = recorder.kernel("paged_attention", reference_attention)
        patch.setattr(attention_mod, "paged_attention", attention)
        with torch.inference_mode(), recorder:
            out = layer(batch.positions, hidden, batch)
    return [op for op in recorder.ops if op not in NO_LAUNCH], out, cache


SPLIT = ["linear", "qk_norm_rope_triton", "write_kv_cache_triton", "paged_attention"]
FUSED = ["linear", "qk_norm_rope_kv_write_triton", "paged_attention"]
LAUNCHES = {
    # model: (launches before, launches now)
    "qwen3": (SPLIT + ["linear"], FUSED + ["linear"]),
    "llama": (SPLIT + ["linear"], FUSED + ["linear"]),
    "qwen3_next": (
        SPLIT + ["reshape", "sigmoid", "mul", "linear"],  # the reshape copies the strided gate
        FUSED + ["mul_sigmoid_triton", "linear"],
    ),
}


@pytest.mark.parametrize("model", sorted(LAUNCHES))
def test_decode_layer_launches_and_bits(model, monkeypatch):
    fused_ops, fused_out, fused_cache = decode_launches(model, monkeypatch, fused=True)
    split_ops, split_out, split_cache = decode_launches(model, monkeypatch, fused=False)
    print(f"{model}: {len(split_ops)} launches {split_ops} -> {len(fused_ops)} {fused_ops}")
    assert (split_ops, fused_ops) == LAUNCHES[model]
    assert torch.equal(fused_out, split_out), "the fused layer's output differs"
    assert torch.equal(fused_cache.view(torch.int16), split_cache.view(torch.int16))


def test_benchmark_tiny_runs_and_matches(tmp_path):
    """benchmarks/attention_launch_fusion.py --tiny (CPU interpreter): every fused result
    is bitwise the unfused one, and the JSON is written."""
    from benchmarks import attention_launch_fusion as bench

    out = tmp_path / "fusion.json"
    result = bench.main(["--tiny", "--out", str(out)])
    assert (
        out.exists()
        and [row["op"] for row in result["rows"]] == ["norm_rope_write"] * 4 + ["output_gate"] * 2
    )
    assert all(row["same_bits"] for row in result["rows"]), result["rows"]
