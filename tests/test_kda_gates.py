"""Kimi Delta Attention gates: the reference against the layer's former two-step code path
(bit for bit), and the one-launch Triton kernel against the reference.

Without CUDA the kernel runs in Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1) at small shapes; with CUDA the same tests run compiled, and the
`gpu`-marked one adds Kimi-Linear's shape (32 heads x 128 channels) and a CUDA-graph capture.
Inputs are fresh random values per case, with raw + dt_bias spread over [-30, 30] and every
row holding values on both sides of softplus's threshold (20).

Tolerances (those of tests/test_gdn_gates.py, whose exp and softplus the kernel shares): g
(float32) within 1e-6 relative; float32 beta within 8 ulps; half beta within one ulp of its
dtype (a last-bit float32 difference can flip one rounding).
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from kvloom.kernels import ops
from kvloom.kernels.kda_gates import kda_gates_ref
from kvloom.kernels.kda_gates_triton import kda_gates_triton
from tests.kernel_env import DEVICE, gpu, needs_cuda

MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
MIN_EXPONENT = {torch.bfloat16: -126, torch.float16: -14, torch.float32: -126}


def seed_of(*case) -> int:
    return zlib.crc32(repr(case).encode())


def make_case(tokens, heads, head_k, dtype, seed, device=DEVICE, param_dtype=None, raw_pad=0):
    """(raw_gate [T, H, Dk], A_log [H], dt_bias [H * Dk], beta_logits [T, H]).

    beta_logits is a column slice of a wider tensor, as the fused qkv_proj output gives it
    (strided rows); raw_pad > 0 makes raw_gate's rows strided too. raw + dt_bias spans
    [-30, 30], with channel 0 of head 0 in [21, 26] and its last channel in [14, 19] on every
    row; A_log = log U(1, 16); beta's logits ~ 4 N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    param_dtype = param_dtype or dtype
    dt_bias = torch.rand(heads * head_k, generator=gen) * 4 - 2
    shifted = torch.rand(tokens, heads, head_k, generator=gen) * 60 - 30
    shifted[:, 0, 0] = torch.rand(tokens, generator=gen) * 5 + 21
    shifted[:, 0, -1] = torch.rand(tokens, generator=gen) * 5 + 14
    raw = shifted - dt_bias.view(heads, head_k)
    a_log = (torch.rand(heads, generator=gen) * 15 + 1).log()
    fused = torch.randn(tokens, heads + 5, generator=gen) * 4
    raw_full = torch.randn(tokens, heads, head_k + raw_pad, generator=gen)
    raw_full[..., :head_k] = raw
    raw_gate = raw_full.to(device, dtype)[..., :head_k]
    beta_logits = fused.to(device, dtype)[:, 3 : 3 + heads]
    return raw_gate, a_log.to(device, param_dtype), dt_bias.to(device, param_dtype), beta_logits


def layer_gates_copy(raw_gate, A_log, dt_bias, beta_logits):
    """A frozen copy of what KimiDeltaAttention.forward computed before the fused kernel:
    kda.kda_log_decay, then torch.sigmoid."""
    heads, head_k = raw_gate.shape[-2:]
    dtype = torch.float64 if raw_gate.dtype == torch.float64 else torch.float32
    shifted = raw_gate.to(dtype) + dt_bias.to(dtype).reshape(heads, head_k)
    g = -A_log.to(dtype).reshape(heads, 1).exp() * F.softplus(shifted, beta=1.0, threshold=20.0)
    return g, torch.sigmoid(beta_logits)


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    bits = MANTISSA_BITS[want.dtype]
    w = want.double()
    _, exponent = torch.frexp(w)
    exponent = (exponent - 1).clamp(min=MIN_EXPONENT[want.dtype])  # subnormal spacing
    ulp = torch.exp2(exponent.double() - bits)
    return (got.double() - w).abs() / ulp


def check_case(name, raw_gate, A_log, dt_bias, beta_logits):
    before = (raw_gate.clone(), beta_logits.clone())
    g, beta = kda_gates_triton(raw_gate, A_log, dt_bias, beta_logits)
    ref_g, ref_beta = kda_gates_ref(raw_gate, A_log, dt_bias, beta_logits)
    assert g.dtype == torch.float32 and beta.dtype == beta_logits.dtype
    assert g.shape == ref_g.shape and beta.shape == ref_beta.shape
    assert g.is_contiguous() and beta.is_contiguous()
    assert torch.isfinite(g).all() and torch.isfinite(beta).all(), f"{name}: non-finite output"
    g, beta, ref_g, ref_beta = g.cpu(), beta.cpu(), ref_g.cpu(), ref_beta.cpu()
    rel = ((g.double() - ref_g.double()).abs() / ref_g.double().abs()).max().item()
    g_ulps = ulps(g, ref_g).max().item()
    beta_ulps = ulps(beta, ref_beta).max().item()
    differing = (beta != ref_beta).float().mean().item()
    print(
        f"ERRNORM {name}: g max_rel={rel:.3e} ({g_ulps:.0f} ulp) "
        f"beta max_ulp={beta_ulps:.0f} differing={differing:.2%}"
    )
    assert rel <= 1e-6, f"{name}: g max relative error {rel:.3e}"
    assert beta_ulps <= (8 if beta.dtype == torch.float32 else 1), f"{name}: beta {beta_ulps} ulps"
    assert torch.equal(raw_gate, before[0]) and torch.equal(beta_logits, before[1]), name
    return g, beta


# ------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_reference_equals_the_layer_code_path(dtype):
    case = make_case(6, 3, 8, dtype, seed=1, device="cpu")
    got_g, got_beta = kda_gates_ref(*case)
    want_g, want_beta = layer_gates_copy(*case)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert got_g.dtype == want_g.dtype == acc and got_beta.dtype == want_beta.dtype == dtype
    assert torch.equal(got_g, want_g) and torch.equal(got_beta, want_beta)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_ops_dispatch_on_the_cpu_is_the_reference(dtype):
    case = make_case(5, 2, 4, dtype, seed=2, device="cpu")
    got, want = ops.kda_gates(*case), kda_gates_ref(*case)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want))


# ---------------------------------------------------------------------- Triton kernel

CASES = [
    # tokens, heads, channels per head, dtype
    (1, 2, 16, torch.bfloat16),  # one token
    (1, 4, 128, torch.float32),  # one decode token at Kimi's head size
    (5, 3, 8, torch.float32),
    (7, 2, 12, torch.bfloat16),  # Dk not a power of 2: masked channels
    (9, 3, 16, torch.float16),
    (70, 2, 16, torch.bfloat16),  # 64-token blocks: a partial second block
    (33, 1, 32, torch.float32),
    (3, 2, 1024, torch.float32),  # one token per program
]


@pytest.mark.parametrize("tokens,heads,head_k,dtype", CASES)
def test_matches_reference(tokens, heads, head_k, dtype):
    case = (tokens, heads, head_k, dtype)
    inputs = make_case(*case, seed=seed_of(*case))
    raw_gate, _, dt_bias, beta_logits = inputs
    assert beta_logits.stride(0) == heads + 5  # a strided view, as the layer passes it
    shifted = raw_gate.float() + dt_bias.float().view(heads, head_k)
    assert ((shifted > 20).any(-1).any(-1) & (shifted < 20).any(-1).any(-1)).all()
    check_case(f"T{tokens} H{heads} Dk{head_k} {dtype}", *inputs)


def test_half_activations_with_float32_parameters():
    inputs = make_case(6, 2, 16, torch.bfloat16, seed=3, param_dtype=torch.float32)
    check_case("bf16 activations, float32 A_log/dt_bias", *inputs)


def test_strided_raw_gate_rows():
    inputs = make_case(6, 3, 16, torch.float32, seed=4, raw_pad=5)
    assert not inputs[0].is_contiguous()
    check_case("strided raw_gate", *inputs)


def test_softplus_threshold_and_tails():
    """raw + dt_bias exactly at and around 20, far negative, and near 0."""
    values = [20.0, 19.99, 20.01, 25.0, -20.0, -60.0, -80.0, 0.0, 1e-4, -1e-4, 3.5, -3.5]
    raw_gate = torch.tensor(values, device=DEVICE).view(1, 1, -1)
    A_log = torch.zeros(1, device=DEVICE)
    dt_bias = torch.zeros(len(values), device=DEVICE)
    beta_logits = torch.tensor([[0.7]], device=DEVICE)
    g, _ = check_case("softplus points", raw_gate, A_log, dt_bias, beta_logits)
    assert g[0, 0, 0].item() == -20.0 and g[0, 0, 3].item() == -25.0  # above 20: x itself


def test_rows_are_independent():
    """Each token's outputs are the same whatever else is in the batch (bit for bit)."""
    raw_gate, A_log, dt_bias, beta_logits = make_case(70, 2, 16, torch.bfloat16, seed=5)
    g, beta = kda_gates_triton(raw_gate, A_log, dt_bias, beta_logits)
    for rows in (torch.tensor([0]), torch.tensor([69]), torch.arange(69, 30, -3)):
        rows = rows.to(DEVICE)
        sub = (raw_gate[rows], A_log, dt_bias, beta_logits[rows])
        sub_g, sub_beta = kda_gates_triton(*sub)
        assert torch.equal(sub_g, g[rows]) and torch.equal(sub_beta, beta[rows])


def test_empty_batch():
    g, beta = kda_gates_triton(*make_case(0, 2, 4, torch.float32, seed=6))
    assert g.shape == (0, 2, 4) and beta.shape == (0, 2)


BAD_ARGS = [
    ("raw_gate", 0, lambda t: t[0]),
    ("raw_gate", 0, lambda t: t.double()),
    ("raw_gate", 0, lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)),
    ("raw_gate", 0, lambda t: t.to(torch.int32)),
    ("A_log", 1, lambda t: t[:-1]),
    ("A_log", 1, lambda t: t[None]),
    ("A_log", 1, lambda t: t.double()),
    ("dt_bias", 2, lambda t: t.view(2, -1)),
    ("dt_bias", 2, lambda t: torch.zeros(16, device=t.device)[::2]),
    ("beta_logits", 3, lambda t: t[:-1]),
    ("beta_logits", 3, lambda t: t.t().contiguous().t()),
    ("beta_logits", 3, lambda t: t.to(torch.int64)),
    ("beta_logits", 3, lambda t: "not a tensor"),
]


@pytest.mark.parametrize("field,index,breaker", BAD_ARGS)
def test_bad_arguments_name_the_field(field, index, breaker):
    good = make_case(3, 2, 4, torch.float32, seed=7)
    kda_gates_triton(*good)  # the unbroken arguments are fine
    bad = good[:index] + (breaker(good[index]),) + good[index + 1 :]
    with pytest.raises(ValueError, match=f"^{field}"):
        kda_gates_triton(*bad)


# ------------------------------------------------------------------------------------- gpu


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 7, 4096])
def test_gpu_kimi_shape_and_cuda_graph(tokens, dtype):
    """Kimi-Linear at TP 1 (32 heads x 128 channels): the compiled kernel, ops' dispatch to
    it, and a captured graph replayed on new inputs."""
    case = (tokens, 32, 128, dtype)
    inputs = make_case(*case, seed=seed_of("gpu", *case))
    check_case(f"gpu T{tokens} {dtype}", *inputs)
    eager = kda_gates_triton(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(ops.kda_gates(*inputs), eager))

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_g, graph_beta = kda_gates_triton(*inputs)
    fresh = make_case(*case, seed=seed_of("gpu fresh", *case))
    for static, new in zip(inputs, fresh):
        static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    eager_g, eager_beta = kda_gates_triton(*inputs)
    assert torch.equal(graph_g, eager_g) and torch.equal(graph_beta, eager_beta)
    check_case(f"gpu T{tokens} {dtype} replay", *inputs)
