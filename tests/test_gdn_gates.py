"""Gated DeltaNet gates: the reference against the layer's code path (bit for bit) and
transformers' Qwen3-Next formulas, and the one-launch Triton kernel against the reference.

Without CUDA the kernel runs in Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1) at small shapes; with CUDA the same tests run compiled, and the
`gpu`-marked ones add Qwen3-Next's shape (16 key heads x 2 value heads each) and a
CUDA-graph capture. Inputs are fresh random values per case, with a + dt_bias spread over
[-30, 30] so softplus meets its threshold (20) and its far-negative tail.

Tolerances: g (float32) within 1e-6 relative (a few ulps: the kernel's softplus is a
series, not torch's log1p(exp(x)), and the GPU's exp is the ex2 approximation); float32
beta within 8 ulps (exp's last bits again), half beta within one ulp of its dtype (a
last-bit float32 difference can flip one rounding).
"""

from __future__ import annotations

import types
import zlib

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from kvloom.kernels.gdn_gates import gdn_gates_ref
from kvloom.kernels.gdn_gates_triton import exp_f32, gdn_gates_triton
from tests.kernel_env import CUDA, DEVICE, gpu, needs_cuda

NAN = float("nan")
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
MIN_EXPONENT = {torch.bfloat16: -126, torch.float16: -14, torch.float32: -126}


def seed_of(*case) -> int:
    return zlib.crc32(repr(case).encode())


def make_case(tokens, num_k_heads, r, dtype, seed, device=DEVICE, extra_cols=0):
    """(ba [T, Hk * 2r] (a column slice of a wider tensor when extra_cols), A_log, dt_bias).

    b ~ 4 N(0, 1); a + dt_bias spans [-30, 30]; A_log = log U(1, 16) as checkpoints hold."""
    gen = torch.Generator().manual_seed(seed)
    num_v = num_k_heads * r
    full = torch.randn(tokens, num_k_heads * 2 * r + extra_cols, generator=gen) * 4
    ba = full[:, extra_cols:].view(tokens, num_k_heads, 2 * r)
    ba[:, :, r:] = torch.rand(tokens, num_k_heads, r, generator=gen) * 56 - 28
    dt_bias = torch.rand(num_v, generator=gen) * 4 - 2
    a_log = (torch.rand(num_v, generator=gen) * 15 + 1).log()
    full = full.to(device, dtype)
    ba = full[:, extra_cols:]
    return ba, a_log.to(device, dtype), dt_bias.to(device, dtype)


def layer_gates_copy(ba, A_log, dt_bias, r):
    """A frozen copy of GatedDeltaNet._split_projections' b/a lines and ._gates."""
    tokens = ba.shape[0]
    num_k_heads = ba.shape[1] // (2 * r)
    num_v_heads = num_k_heads * r
    b, a = ba.view(tokens, num_k_heads, 2 * r).split([r, r], dim=-1)
    b, a = b.reshape(tokens, num_v_heads), a.reshape(tokens, num_v_heads)
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    g = -A_log.to(acc).exp() * F.softplus(a.to(acc) + dt_bias.to(acc))
    return g, b.sigmoid()


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    bits = MANTISSA_BITS[want.dtype]
    w = want.double()
    _, exponent = torch.frexp(w)
    exponent = (exponent - 1).clamp(min=MIN_EXPONENT[want.dtype])  # subnormal spacing
    ulp = torch.exp2(exponent.double() - bits)
    return (got.double() - w).abs() / ulp


def check_case(name, ba, A_log, dt_bias, r):
    before = ba.clone()
    g, beta = gdn_gates_triton(ba, A_log, dt_bias, r)
    ref_g, ref_beta = gdn_gates_ref(ba, A_log, dt_bias, r)
    assert g.dtype == torch.float32 and beta.dtype == ba.dtype
    assert g.shape == ref_g.shape and beta.shape == ref_beta.shape
    assert g.is_contiguous() and beta.is_contiguous()
    assert torch.isfinite(g).all() and torch.isfinite(beta).all(), f"{name}: non-finite output"
    g, beta, ref_g, ref_beta = g.cpu(), beta.cpu(), ref_g.cpu(), ref_beta.cpu()
    rel = ((g.double() - ref_g.double()).abs() / ref_g.double().abs()).max().item()
    beta_ulps = ulps(beta, ref_beta).max().item()
    differing = (beta != ref_beta).float().mean().item()
    g_ulps = ulps(g, ref_g).max().item()
    print(
        f"ERRNORM {name}: g max_rel={rel:.3e} ({g_ulps:.0f} ulp) "
        f"beta max_ulp={beta_ulps:.0f} differing={differing:.2%}"
    )
    assert rel <= 1e-6, f"{name}: g max relative error {rel:.3e}"
    # float32 beta: a few ulps, as g; half beta: within one ulp after the final rounding.
    assert beta_ulps <= (8 if beta.dtype == torch.float32 else 1), f"{name}: beta {beta_ulps} ulps"
    assert torch.equal(ba, before), f"{name}: ba was written"
    return g, beta


# ------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_reference_equals_the_layer_code_path(dtype):
    ba, A_log, dt_bias = make_case(6, 3, 4, dtype, seed=1, device="cpu")
    got_g, got_beta = gdn_gates_ref(ba, A_log, dt_bias, 4)
    want_g, want_beta = layer_gates_copy(ba, A_log, dt_bias, 4)
    assert got_g.dtype == want_g.dtype and got_beta.dtype == want_beta.dtype == dtype
    assert torch.equal(got_g, want_g) and torch.equal(got_beta, want_beta)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_transformers_qwen3_next(dtype):
    """transformers' own split (fix_query_key_value_ordering) and gate formulas."""
    tokens, num_k, r, dk, dv = 5, 2, 3, 4, 6
    ba, A_log, dt_bias = make_case(tokens, num_k, r, dtype, seed=2, device="cpu")
    owner = types.SimpleNamespace(
        num_k_heads=num_k, num_v_heads=num_k * r, head_k_dim=dk, head_v_dim=dv
    )
    qkvz = torch.zeros(1, tokens, num_k * (2 * dk + 2 * r * dv), dtype=dtype)
    *_, b, a = Qwen3NextGatedDeltaNet.fix_query_key_value_ordering(owner, qkvz, ba[None])
    hf_beta = b.sigmoid()
    hf_g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    g, beta = gdn_gates_ref(ba, A_log, dt_bias, r)
    assert torch.equal(g, hf_g[0]) and torch.equal(beta, hf_beta[0])


# ---------------------------------------------------------------------- Triton kernel


@triton.jit
def _exp_f32_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, exp_f32(x), mask=offs < n)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # exp(100) = inf
def test_exp_f32_is_accurate_over_the_whole_range():
    """Within 3 ulps of the float64 exp from -87 to 88 (interpreted, numpy's own float32
    exp is off by up to ~2.3 ulps; compiled 4: the GPU's ex2 approximation adds up to ~2
    to the reduction's ~0.5); overflow, underflow, +-inf and NaN as torch.exp; subnormal
    results within 2 subnormal steps (compiled too: Triton does not flush them)."""
    gen = torch.Generator().manual_seed(10)
    x = torch.cat(
        (
            torch.linspace(-87.0, 88.7, 4001),
            torch.rand(4000, generator=gen) * 175.7 - 87.0,
            torch.tensor([0.0, -0.0, 1e-30, -1e-30, 0.5 * 0.6931472, -0.5 * 0.6931472]),
        )
    )
    special = torch.tensor([88.8, 100.0, -104.0, -200.0, float("inf"), -float("inf"), NAN])
    subnormal = torch.tensor([-88.0, -95.0, -103.0])
    inputs = torch.cat((x, special, subnormal)).to(DEVICE)
    out = torch.empty_like(inputs)
    _exp_f32_kernel[(triton.cdiv(inputs.numel(), 1024),)](inputs, out, inputs.numel(), 1024)
    out = out.cpu()
    want = x.double().exp()
    ulp = torch.exp2(torch.frexp(want)[1].double() - 1 - 23)  # float32 spacing at the truth
    err = ((out[: x.numel()].double() - want).abs() / ulp).max().item()
    print(f"ERRNORM exp_f32: max_ulp={err:.2f}")
    assert err <= (4 if CUDA else 3), f"exp_f32: {err} ulps"
    tail = out[x.numel() :]
    torch.testing.assert_close(tail[: special.numel()], special.exp(), equal_nan=True)
    sub = tail[special.numel() :].double()
    want_sub = subnormal.double().exp()
    step = 2.0**-149
    assert ((sub - want_sub).abs() <= 2 * step).all() and (sub >= 0).all()


CASES = [
    # tokens, key heads, value heads per key head, dtype
    (1, 2, 2, torch.bfloat16),
    (1, 16, 2, torch.bfloat16),  # Qwen3-Next, one rank
    (5, 4, 1, torch.float32),
    (7, 2, 3, torch.bfloat16),
    (7, 2, 3, torch.float32),
    (9, 3, 4, torch.float16),
    (70, 8, 2, torch.bfloat16),  # several token blocks, a partial last one
    (33, 1, 1, torch.float32),
]


@pytest.mark.parametrize("tokens,num_k,r,dtype", CASES)
def test_matches_reference(tokens, num_k, r, dtype):
    case = (tokens, num_k, r, dtype)
    ba, A_log, dt_bias = make_case(*case, seed=seed_of(*case))
    check_case(f"T{tokens} Hk{num_k} r{r} {dtype}", ba, A_log, dt_bias, r)


def test_softplus_threshold_and_tails():
    """a + dt_bias exactly at and around 20, far negative, and near 0."""
    values = [20.0, 19.99, 20.01, 25.0, -20.0, -60.0, -80.0, 0.0, 1e-4, -1e-4, 3.5, -3.5]
    a = torch.tensor(values, dtype=torch.float32)
    ba = torch.stack([torch.ones_like(a), a], dim=1).reshape(1, -1).to(DEVICE)  # Hk=12, r=1
    num = len(values)
    A_log, dt_bias = torch.zeros(num, device=DEVICE), torch.zeros(num, device=DEVICE)
    g, _ = check_case("softplus points", ba, A_log, dt_bias, 1)
    assert g[0, 0].item() == -20.0 and g[0, 3].item() == -25.0  # above the threshold: x


def test_strided_rows():
    ba, A_log, dt_bias = make_case(6, 2, 2, torch.bfloat16, seed=3, extra_cols=5)
    assert not ba.is_contiguous()
    check_case("strided ba", ba, A_log, dt_bias, 2)


def test_empty_batch():
    ba, A_log, dt_bias = make_case(0, 2, 2, torch.float32, seed=4)
    g, beta = gdn_gates_triton(ba, A_log, dt_bias, 2)
    assert g.shape == (0, 4) and beta.shape == (0, 4)


BAD_ARGS = [
    ("ba", 0, lambda t: t[:, :-1]),
    ("ba", 0, lambda t: t[0]),
    ("ba", 0, lambda t: t.double()),
    ("ba", 0, lambda t: t.t().contiguous().t()),
    ("ba", 0, lambda t: t.to(torch.int32)),
    ("A_log", 1, lambda t: t[:-1]),
    ("A_log", 1, lambda t: t.double()),
    ("dt_bias", 2, lambda t: t[None]),
    ("dt_bias", 2, lambda t: torch.zeros(8, device=t.device)[::2]),
    ("group_v_heads", 3, lambda r: 0),
    ("group_v_heads", 3, lambda r: True),
    ("ba", 3, lambda r: 3),  # 8 columns are not whole groups of 2 * 3
]


@pytest.mark.parametrize("field,index,breaker", BAD_ARGS)
def test_bad_arguments_name_the_field(field, index, breaker):
    good = (*make_case(3, 2, 2, torch.float32, seed=5), 2)
    gdn_gates_triton(*good)  # the unbroken arguments are fine
    bad = good[:index] + (breaker(good[index]),) + good[index + 1 :]
    with pytest.raises(ValueError, match=f"^{field}"):
        gdn_gates_triton(*bad)


# ------------------------------------------------------------------------------------- gpu


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 8, 4096])
@pytest.mark.parametrize("num_k", [16, 8])  # Qwen3-Next at TP 1 and 2
def test_gpu_qwen3_next_shape_and_cuda_graph(num_k, tokens):
    case = (tokens, num_k, 2, torch.bfloat16)
    ba, A_log, dt_bias = make_case(*case, seed=seed_of("gpu", *case))
    check_case(f"gpu T{tokens} Hk{num_k}", ba, A_log, dt_bias, 2)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_g, graph_beta = gdn_gates_triton(ba, A_log, dt_bias, 2)
    fresh = make_case(*case, seed=seed_of("gpu fresh", *case))
    for static, new in zip((ba, A_log, dt_bias), fresh):
        static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    eager_g, eager_beta = gdn_gates_triton(ba, A_log, dt_bias, 2)
    assert torch.equal(graph_g, eager_g) and torch.equal(graph_beta, eager_beta)
    check_case(f"gpu T{tokens} Hk{num_k} replay", ba, A_log, dt_bias, 2)
