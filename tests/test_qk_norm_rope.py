"""Fused q/k RMSNorm + rotary (`qk_norm_rope_triton`) against its pure-torch reference.

Without CUDA the kernel runs in Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1) at small shapes; with CUDA the same tests run compiled, and the
`gpu`-marked ones add the Qwen3-8B and Qwen3-Next attention shapes plus CUDA-graph capture.
q and k are head views sliced from one fused [T, (Hq + 2 Hk) * D] projection output, as
the attention layers pass them; inputs are fresh random values on every case.

Tolerances, per head row, relative to that row's largest |reference value|:
  float32  2e-6: the mean of squares and rsqrt may differ from torch in the last bits.
  bfloat16 2^-6, float16 2^-9 (two ulps of the row's largest value): a last-bit float32
           difference in the norm can flip one rounding to the half dtype; then one ulp
           moves through the rotary products. Such flips are rare, so at most 1% of half
           elements may differ at all.
The interpreter narrows float32 to bfloat16 by truncation where the GPU and torch round to
nearest even; the tests/triton_interpret helper makes it round, so both mean the same.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from kvloom.kernels.qk_norm_rope import qk_norm_rope_ref
from kvloom.kernels.qk_norm_rope_triton import qk_norm_rope_triton
from tests.kernel_env import DEVICE, gpu, needs_cuda

ROW_TOL = {torch.float32: 2e-6, torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9}
MAX_POS = 512
EPS = 1e-6


def rope_tables(rotary_dim: int, max_pos: int = MAX_POS, theta: float = 1e6):
    """Real cos/sin tables [max_pos, rotary_dim // 2] in float32, as the rotary layer has."""
    inv_freq = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq
    return angles.cos().to(DEVICE), angles.sin().to(DEVICE)


def make_case(
    tokens, q_heads, k_heads, dim, rotary_dim, norm, dtype, seed, max_pos=MAX_POS, scale=3.0
):
    """Kernel arguments: q/k are head views of one fused qkv tensor (strided rows).

    norm: None (rotary only), 0.0 (w scaling) or 1.0 ((1 + w) scaling).
    """
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * dim, generator=gen) * scale
    qkv = qkv.to(dtype=dtype, device=DEVICE)
    q_size, k_size = q_heads * dim, k_heads * dim
    q = qkv[:, :q_size].view(tokens, q_heads, dim)
    k = qkv[:, q_size : q_size + k_size].view(tokens, k_heads, dim)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(DEVICE)
    cos, sin = rope_tables(rotary_dim, max_pos)
    if norm is None:
        q_weight = k_weight = None
    else:
        # (1 + w) checkpoints store w near 0; plain ones store w near 1.
        centre = 0.0 if norm else 1.0
        q_weight = (torch.randn(dim, generator=gen) * 0.2 + centre).to(dtype=dtype, device=DEVICE)
        k_weight = (torch.randn(dim, generator=gen) * 0.2 + centre).to(dtype=dtype, device=DEVICE)
    args = (q, k, positions, cos, sin, q_weight, k_weight, EPS, rotary_dim, norm or 0.0)
    return qkv, args


def assert_matches(name, got, want):
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.dtype, got.shape)
    assert got.is_contiguous(), f"{name}: output not contiguous"
    g, w = got.double().cpu(), want.double().cpu()
    assert torch.isfinite(g).all(), f"{name}: non-finite value in the kernel's output"
    scale = w.abs().amax(-1, keepdim=True)
    err = (g - w).abs()
    worst = (err / scale).max().item() if err.numel() else 0.0
    print(f"ERRNORM {name}: max_err/row_max={worst:.3e}")
    assert (err <= ROW_TOL[got.dtype] * scale).all(), f"{name}: max err/row max {worst:.3e}"
    if got.dtype != torch.float32:
        differing = (got != want).float().mean().item() if got.numel() else 0.0
        assert differing <= 0.01, f"{name}: {differing:.2%} of elements differ"


def check_case(name, qkv, args):
    before = qkv.clone()
    q_out, k_out = qk_norm_rope_triton(*args)
    ref_q, ref_k = qk_norm_rope_ref(*args)
    assert_matches(f"{name} q", q_out, ref_q)
    assert_matches(f"{name} k", k_out, ref_k)
    assert torch.equal(qkv, before), f"{name}: the inputs were written"
    return q_out, k_out


def seed_of(*case) -> int:
    return zlib.crc32(repr(case).encode())


# Every head dim x rotary width x norm mode x dtype at T in {1, 5}; GQA shape varies with
# the rotary width, so each head dim meets both group sizes.
GRID = [
    (tokens, *((4, 2) if rot == "full" else (8, 1)), dim, rot, norm, dtype)
    for dim, rot, norm, dtype, tokens in itertools.product(
        (64, 128, 80),
        ("full", "quarter"),
        (None, 0.0, 1.0),
        (torch.float32, torch.bfloat16),
        (1, 5),
    )
]
# T = 33 on a few mixes, and float16 once.
EXTRA = [
    (33, 8, 1, 80, "quarter", 1.0, torch.bfloat16),
    (33, 4, 2, 128, "full", 0.0, torch.bfloat16),
    (33, 4, 2, 64, "full", None, torch.float32),
    (33, 8, 1, 128, "quarter", 0.0, torch.float32),
    (5, 4, 2, 80, "quarter", 0.0, torch.float16),
]


@pytest.mark.parametrize("tokens,q_heads,k_heads,dim,rot,norm,dtype", GRID + EXTRA)
def test_matches_reference(tokens, q_heads, k_heads, dim, rot, norm, dtype):
    rotary_dim = dim if rot == "full" else dim // 4
    case = (tokens, q_heads, k_heads, dim, rotary_dim, norm, dtype)
    qkv, args = make_case(*case, seed=seed_of(*case))
    check_case(f"T{tokens} h{q_heads}/{k_heads} d{dim} r{rotary_dim} n{norm} {dtype}", qkv, args)


def test_contiguous_inputs_and_int32_positions():
    _, args = make_case(5, 4, 2, 64, 32, 0.0, torch.bfloat16, seed=11)
    q, k, positions = args[0].contiguous(), args[1].contiguous(), args[2].to(torch.int32)
    args = (q, k, positions, *args[3:])
    qkv = torch.cat((q.flatten(1), k.flatten(1)), dim=1)
    q_out, k_out = qk_norm_rope_triton(*args)
    ref_q, ref_k = qk_norm_rope_ref(*args)
    assert_matches("contiguous q", q_out, ref_q)
    assert_matches("contiguous k", k_out, ref_k)
    assert torch.equal(torch.cat((q.flatten(1), k.flatten(1)), dim=1), qkv)


def test_each_token_uses_its_own_position():
    """Swapping two tokens' positions changes only those tokens' outputs."""
    _, args = make_case(5, 4, 2, 64, 64, 0.0, torch.float32, seed=12)
    args = args[:2] + (torch.tensor([5, 100, 200, 300, 400], device=DEVICE),) + args[3:]
    q_out, k_out = qk_norm_rope_triton(*args)
    positions = args[2].clone()
    positions[[0, 3]] = positions[[3, 0]]
    swapped = qk_norm_rope_triton(args[0], args[1], positions, *args[3:])
    ref_q, _ = qk_norm_rope_ref(args[0], args[1], positions, *args[3:])
    assert_matches("swapped q", swapped[0], ref_q)
    assert not torch.equal(swapped[0][0], q_out[0])
    assert torch.equal(swapped[0][1:3], q_out[1:3]) and torch.equal(swapped[1][4], k_out[4])


def test_empty_batch():
    _, args = make_case(0, 4, 2, 64, 64, 0.0, torch.float32, seed=13)
    q_out, k_out = qk_norm_rope_triton(*args)
    assert q_out.shape == (0, 4, 64) and k_out.shape == (0, 2, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_hugging_face_qwen3(dtype):
    """The reference is Qwen3's q_norm / k_norm then apply_rotary_pos_emb, bit for bit."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    _, args = make_case(7, 4, 2, 32, 32, 0.0, dtype, seed=14)
    q, k, positions, cos_table, sin_table, q_weight, k_weight = (a.cpu() for a in args[:7])
    norms = []
    for weight in (q_weight, k_weight):
        norm = Qwen3RMSNorm(32, eps=EPS).to(dtype)
        norm.weight.data.copy_(weight)
        norms.append(norm)
    # HF keeps [B, H, T, D] and full-width cos/sin (each frequency twice), cast to dtype.
    cos = torch.cat((cos_table[positions],) * 2, dim=-1).to(dtype)[None]
    sin = torch.cat((sin_table[positions],) * 2, dim=-1).to(dtype)[None]
    hf_q, hf_k = apply_rotary_pos_emb(
        norms[0](q).transpose(0, 1)[None], norms[1](k).transpose(0, 1)[None], cos, sin
    )
    ref_q, ref_k = qk_norm_rope_ref(q, k, positions, cos_table, sin_table, q_weight, k_weight, EPS)
    assert torch.equal(ref_q, hf_q[0].transpose(0, 1))
    assert torch.equal(ref_k, hf_k[0].transpose(0, 1))


# (argument that is wrong, its index in the argument tuple, how to break the good value)
BAD_ARGS = [
    ("q", 0, lambda q: q[0]),
    ("q", 0, lambda q: q.double()),
    ("q", 0, lambda q: q.transpose(1, 2).contiguous().transpose(1, 2)),
    ("k", 1, lambda k: k[:, :, :8]),
    ("k", 1, lambda k: k[:2]),
    ("k", 1, lambda k: k.to(torch.bfloat16)),
    ("positions", 2, lambda p: p[:2]),
    ("positions", 2, lambda p: p.float()),
    ("cos_table", 3, lambda c: c[:, :2]),
    ("sin_table", 4, lambda s: s[:7]),
    ("sin_table", 4, lambda s: s.double()),
    ("q_weight", 5, lambda w: w[:8]),
    ("k_weight", 6, lambda w: w.to(torch.bfloat16)),
    ("k_weight", 6, lambda w: None),
    ("q_weight", 5, lambda w: None),
    ("rotary_dim", 8, lambda r: 7),
    ("rotary_dim", 8, lambda r: 32),
    ("weight_offset", None, None),  # an offset with no weights: no norm to offset
]


@pytest.mark.parametrize("field,index,breaker", BAD_ARGS)
def test_bad_arguments_name_the_field(field, index, breaker):
    _, good = make_case(3, 4, 2, 16, 8, 0.0, torch.float32, seed=15)
    qk_norm_rope_triton(*good)  # the unbroken arguments are fine
    if index is None:
        bad = good[:5] + (None, None, EPS, 8, 1.0)
    else:
        bad = good[:index] + (breaker(good[index]),) + good[index + 1 :]
    with pytest.raises(ValueError, match=f"^{field}:"):
        qk_norm_rope_triton(*bad)


# ------------------------------------------------------------------------------------- gpu

GPU_SHAPES = {
    # (q_heads, k_heads, head_dim, rotary_dim, weight_offset)
    "qwen3_8b": (32, 8, 128, 128, 0.0),
    "qwen3_next": (16, 2, 256, 64, 1.0),
}


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 256])
@pytest.mark.parametrize("model", sorted(GPU_SHAPES))
def test_gpu_real_shapes_and_cuda_graph(model, tokens):
    q_heads, k_heads, dim, rotary_dim, offset = GPU_SHAPES[model]
    case = (tokens, q_heads, k_heads, dim, rotary_dim, offset, torch.bfloat16)
    qkv, args = make_case(*case, seed=seed_of(model, tokens), max_pos=40960)
    check_case(f"gpu {model} T{tokens}", qkv, args)

    # Capture on static inputs, refill them in place, replay: equal to eager on the new values.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_q, graph_k = qk_norm_rope_triton(*args)
    fresh_qkv, fresh_args = make_case(*case, seed=seed_of(model, tokens, "fresh"), max_pos=40960)
    qkv.copy_(fresh_qkv)
    args[2].copy_(fresh_args[2])  # positions
    args[5].copy_(fresh_args[5])  # weights
    args[6].copy_(fresh_args[6])
    graph.replay()
    torch.cuda.synchronize()
    eager_q, eager_k = qk_norm_rope_triton(*args)
    assert torch.equal(graph_q, eager_q) and torch.equal(graph_k, eager_k)
    ref_q, ref_k = qk_norm_rope_ref(*args)
    assert_matches(f"gpu {model} T{tokens} replay q", graph_q, ref_q)
    assert_matches(f"gpu {model} T{tokens} replay k", graph_k, ref_k)
