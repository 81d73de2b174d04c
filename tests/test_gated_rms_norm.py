"""Gated RMSNorm: the reference against the layer's GatedRMSNorm (a frozen copy) and
transformers' Qwen3NextRMSNormGated, bit for bit, and the Triton kernel against the
reference, the gate read as a strided view of a fused in_proj_qkvz output.

Without CUDA the kernel runs in Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1) at small shapes; with CUDA the same tests run compiled, and the
`gpu`-marked ones add Qwen3-Next's shape (16 key heads x 2 value heads, D = 128) and a
CUDA-graph capture. Inputs are fresh random values per case.

Tolerances, in units in the last place (ulps) of each reference element: float32 at most
32 ulps (~2e-6: the float32 chain, the mean's summation order and rsqrt's last bits, with
no rounding to hide them); half dtypes at most 4 ulps, on at most 1% of elements. A
last-bit float32 difference in the mean of squares or rsqrt flips the rounding of the
normalised value h by one of its ulps, up to 2^-(m-1) relative (m mantissa bits), and the
two roundings after it (weight product, output) add up to 2^-m each: 2^-(m-2) relative
at most, i.e. <= 4 ulps of the output. Simulated on the CPU, one-ulp rsqrt changes gave
3 (bfloat16) and 4 (float16) at worst, on ~1e-4 of elements; the interpreter runs show
none at all.
"""

from __future__ import annotations

import types
import zlib

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextGatedDeltaNet,
    Qwen3NextRMSNormGated,
)

from kvloom.kernels.gated_rms_norm import gated_rms_norm_ref
from kvloom.kernels.gated_rms_norm_triton import gated_rms_norm_triton
from tests.kernel_env import DEVICE, gpu, needs_cuda

MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
MAX_ULPS = {torch.bfloat16: 4, torch.float16: 4, torch.float32: 32}
MIN_EXPONENT = {torch.bfloat16: -126, torch.float16: -14, torch.float32: -126}
EPS = 1e-6


def seed_of(*case) -> int:
    return zlib.crc32(repr(case).encode())


def make_case(tokens, num_k, r, dk, dv, dtype, seed, weight_dtype=None, device=DEVICE):
    """(qkvz, x [T, Hv, Dv], z view [T, Hk, r, Dv] into qkvz, weight [Dv]).

    x is a core-attention-like output (scale varies per row); the weight is near 1, as a
    plain (not 1 + w) checkpoint weight."""
    gen = torch.Generator().manual_seed(seed)
    group_width = 2 * dk + 2 * r * dv
    qkvz = (torch.randn(tokens, num_k * group_width, generator=gen) * 3).to(device, dtype)
    z = qkvz.view(tokens, num_k, group_width)[..., 2 * dk + r * dv :].view(tokens, num_k, r, dv)
    scale = torch.rand(tokens, num_k * r, 1, generator=gen) * 4 + 0.05
    x = (torch.randn(tokens, num_k * r, dv, generator=gen) * scale).to(device, dtype)
    weight = torch.randn(dv, generator=gen) * 0.2 + 1
    return qkvz, x, z, weight.to(device, weight_dtype or dtype)


def layer_forward_copy(x, gate, weight, eps):
    """A frozen copy of GatedRMSNorm.forward in workers/layers/gated_deltanet.py."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(acc)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(x.dtype)
    return (h * F.silu(gate.to(acc))).to(x.dtype)


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    bits = MANTISSA_BITS[want.dtype]
    w = want.double()
    _, exponent = torch.frexp(w)
    exponent = (exponent - 1).clamp(min=MIN_EXPONENT[want.dtype])  # subnormal spacing
    ulp = torch.exp2(exponent.double() - bits)
    return (got.double() - w).abs() / ulp


def check_case(name, qkvz, x, z, weight):
    before_qkvz, before_x = qkvz.clone(), x.clone()
    out = gated_rms_norm_triton(x, z, weight, EPS)
    ref = gated_rms_norm_ref(x, z, weight, EPS)
    assert out.dtype == x.dtype and out.shape == x.shape and out.is_contiguous()
    assert torch.isfinite(out).all(), f"{name}: non-finite output"
    out, ref = out.cpu(), ref.cpu()
    err = ulps(out, ref)
    differing = (out != ref).float().mean().item()
    rel = ((out.double() - ref.double()).abs().amax(-1) / ref.double().abs().amax(-1)).max()
    print(
        f"ERRNORM {name}: max_ulp={err.max().item():.0f} differing={differing:.2%} "
        f"max_err/row_max={rel.item():.3e}"
    )
    assert err.max().item() <= MAX_ULPS[out.dtype], f"{name}: {err.max().item()} ulps"
    if out.dtype != torch.float32:
        assert differing <= 0.01, f"{name}: {differing:.2%} of elements differ"
    assert torch.equal(qkvz, before_qkvz) and torch.equal(x, before_x), f"{name}: input written"
    return out


# ------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_reference_equals_layer_and_transformers(dtype):
    _, x, z, weight = make_case(5, 2, 3, 8, 16, dtype, seed=1, device="cpu")
    gate = z.reshape(5, 6, 16)
    ref = gated_rms_norm_ref(x, z, weight, EPS)
    assert torch.equal(ref, layer_forward_copy(x, gate, weight, EPS))
    assert torch.equal(gated_rms_norm_ref(x, gate, weight, EPS), ref)  # a [T, Hv, D] gate
    if dtype != torch.float64:  # transformers computes in float32 whatever the dtype
        hf = Qwen3NextRMSNormGated(16, eps=EPS).to(dtype)
        hf.weight.data.copy_(weight)
        with torch.no_grad():
            assert torch.equal(ref, hf(x, gate))


def test_gate_view_is_transformers_z():
    """The [T, Hk, r, Dv] view into in_proj_qkvz's output is the z transformers' own split
    (fix_query_key_value_ordering) makes, head for head."""
    tokens, num_k, r, dk, dv = 4, 3, 2, 8, 16
    qkvz, x, z, weight = make_case(tokens, num_k, r, dk, dv, torch.float32, seed=9)
    owner = types.SimpleNamespace(
        num_k_heads=num_k, num_v_heads=num_k * r, head_k_dim=dk, head_v_dim=dv
    )
    ba = torch.zeros(1, tokens, num_k * 2 * r, device=DEVICE)
    hf_z = Qwen3NextGatedDeltaNet.fix_query_key_value_ordering(owner, qkvz[None], ba)[3][0]
    assert torch.equal(z.reshape(tokens, num_k * r, dv), hf_z)
    check_case("transformers z", qkvz, x, z, weight)
    assert torch.equal(
        gated_rms_norm_ref(x, z, weight, EPS), gated_rms_norm_ref(x, hf_z, weight, EPS)
    )


def test_reference_rounds_the_weight_product_only_in_its_promoted_dtype():
    """A float32 weight with bfloat16 x: the product stays float32 (torch promotion)."""
    _, x, z, weight = make_case(3, 2, 2, 8, 16, torch.bfloat16, seed=2, device="cpu")
    weight32 = weight.float() + 1e-3  # not representable in bfloat16
    ref = gated_rms_norm_ref(x, z, weight32, EPS)
    assert torch.equal(ref, layer_forward_copy(x, z.reshape(3, 4, 16), weight32, EPS))


# ---------------------------------------------------------------------- Triton kernel

CASES = [
    # tokens, key heads, r, Dk, Dv, dtype
    (1, 2, 2, 16, 32, torch.bfloat16),
    (3, 2, 2, 16, 128, torch.bfloat16),
    (5, 4, 1, 8, 64, torch.float32),
    (7, 2, 3, 16, 80, torch.bfloat16),  # D not a power of two
    (7, 2, 3, 16, 80, torch.float32),
    (4, 3, 2, 8, 64, torch.float16),
    (33, 1, 2, 8, 32, torch.bfloat16),  # several programs, a partial last one
    (2, 1, 1, 4, 1, torch.float32),  # D = 1
]


@pytest.mark.parametrize("tokens,num_k,r,dk,dv,dtype", CASES)
def test_matches_reference(tokens, num_k, r, dk, dv, dtype):
    case = (tokens, num_k, r, dk, dv, dtype)
    check_case(f"T{tokens} Hk{num_k} r{r} D{dv} {dtype}", *make_case(*case, seed=seed_of(*case)))


def test_float32_weight_with_bfloat16_activations():
    qkvz, x, z, _ = make_case(5, 2, 2, 8, 64, torch.bfloat16, seed=3)
    weight32 = torch.linspace(0.5, 1.5, 64, device=DEVICE) + 1e-3
    check_case("f32 weight", qkvz, x, z, weight32)


def test_plain_gate_and_strided_x():
    """A gate of x's shape, and x as a strided view (its heads of a wider tensor)."""
    qkvz, x, z, weight = make_case(6, 2, 2, 8, 64, torch.bfloat16, seed=4)
    gate = z.reshape(6, 4, 64).contiguous()
    check_case("plain gate", qkvz, x, gate, weight)
    wide = torch.randn(6, 5, 64, generator=torch.Generator().manual_seed(5))
    wide = wide.to(DEVICE, torch.bfloat16)
    check_case("strided x", qkvz, wide[:, 1:], z, weight)


def test_rows_do_not_depend_on_the_batch():
    """Invariant 7: the block depends on D only; one row gives the same bits alone or in
    a batch."""
    qkvz, x, z, weight = make_case(9, 2, 2, 8, 64, torch.bfloat16, seed=6)
    full = gated_rms_norm_triton(x, z, weight, EPS)
    alone = gated_rms_norm_triton(x[4:5], z[4:5], weight, EPS)
    assert torch.equal(full[4:5], alone)


def test_sum_of_squares_over_magnitudes_and_non_finite_rows():
    """The kernel's order-free sum of squares (`sum_of_squares`, fixed point scaled per
    row) keeps float32 rows of very different magnitudes as accurate as torch's float32
    sum, and rows with inf or NaN come out as torch's do (NaN where torch's is)."""
    gen = torch.Generator().manual_seed(11)
    rows = []
    for scale in (1e-18, 1e-3, 1.0, 7e2, 1e17):
        row = torch.randn(16, generator=gen) * scale
        row[3] *= 1e-4  # a small element beside large ones
        rows.append(row)
    x = torch.stack(rows).view(5, 1, 16).to(DEVICE)
    gate = (torch.randn(5, 1, 16, generator=gen) * 3).to(DEVICE)
    weight = (torch.randn(16, generator=gen) * 0.2 + 1).to(DEVICE)
    out = gated_rms_norm_triton(x, gate, weight, EPS).cpu()
    ref = gated_rms_norm_ref(x, gate, weight, EPS).cpu()
    assert ulps(out, ref).max().item() <= MAX_ULPS[torch.float32]

    bad = x[:3].clone()
    bad[0, 0, 5], bad[1, 0, 2], bad[2, 0, 7] = float("nan"), float("inf"), -float("inf")
    out = gated_rms_norm_triton(bad, gate[:3], weight, EPS).cpu()
    ref = gated_rms_norm_ref(bad, gate[:3], weight, EPS).cpu()
    assert torch.equal(out.isnan(), ref.isnan()) and ref.isnan().any()
    finite = ~ref.isnan()
    assert torch.equal(out[finite], ref[finite])  # zeros: x / sqrt(inf)


def test_empty_batch():
    _, x, z, weight = make_case(0, 2, 2, 8, 16, torch.float32, seed=7)
    assert gated_rms_norm_triton(x, z, weight, EPS).shape == (0, 4, 16)


BAD_ARGS = [
    ("x", 0, lambda t: t[0]),
    ("x", 0, lambda t: t.double()),
    ("x", 0, lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)),
    ("gate", 1, lambda t: t[:, :1]),
    ("gate", 1, lambda t: t[:2]),
    ("gate", 1, lambda t: t.transpose(2, 3).contiguous().transpose(2, 3)),
    ("gate", 1, lambda t: t.to(torch.int32)),
    ("weight", 2, lambda t: t[:8]),
    ("weight", 2, lambda t: t.double()),
    ("eps", 3, lambda e: -1.0),
    ("eps", 3, lambda e: float("nan")),
    ("eps", 3, lambda e: None),
]


@pytest.mark.parametrize("field,index,breaker", BAD_ARGS)
def test_bad_arguments_name_the_field(field, index, breaker):
    _, x, z, weight = make_case(3, 2, 2, 8, 16, torch.float32, seed=8)
    good = (x, z, weight, EPS)
    gated_rms_norm_triton(*good)  # the unbroken arguments are fine
    bad = good[:index] + (breaker(good[index]),) + good[index + 1 :]
    with pytest.raises(ValueError, match=f"^{field}"):
        gated_rms_norm_triton(*bad)


# ------------------------------------------------------------------------------------- gpu


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 8, 4096])
@pytest.mark.parametrize("num_k", [16, 8])  # Qwen3-Next at TP 1 and 2
def test_gpu_qwen3_next_shape_and_cuda_graph(num_k, tokens):
    case = (tokens, num_k, 2, 128, 128, torch.bfloat16)
    qkvz, x, z, weight = make_case(*case, seed=seed_of("gpu", *case))
    check_case(f"gpu T{tokens} Hk{num_k}", qkvz, x, z, weight)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = gated_rms_norm_triton(x, z, weight, EPS)
    fresh_qkvz, fresh_x, _, fresh_w = make_case(*case, seed=seed_of("gpu fresh", *case))
    qkvz.copy_(fresh_qkvz)
    x.copy_(fresh_x)
    weight.copy_(fresh_w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, gated_rms_norm_triton(x, z, weight, EPS))
    check_case(f"gpu T{tokens} Hk{num_k} replay", qkvz, x, z, weight)
