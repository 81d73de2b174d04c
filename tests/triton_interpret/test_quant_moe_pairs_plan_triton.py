"""The W4A16 and FP8 fused MoE take the float MoE's pairs (decode) plan (every route its
own block, expert read from topk_ids, no count/place launches): bitwise the sorted plans'
output at every token count, with experts shared across tokens, a folded shared expert
(the last stacked expert, in every token's last slot), top_k 1 and > 1, and ids out of
range. Interpreted on the CPU at tiny shapes; compiled on a GPU, where the `gpu`-marked
tests add Qwen3-Next's MoE shape and the automatic plan choice.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvloom.kernels.fused_moe_triton import PAIRS_PLAN_MAX_TOKENS
from tests.kernel_env import DEVICE, gpu, needs_cuda

pytestmark = pytest.mark.skipif(
    os.environ.get("KVLOOM_TRITON_CHECKS_IN_SUBPROCESS") == "1",
    reason="triton was imported for the compiler first (run this module alone)",
)

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpret.conftest import round_fp8_like_the_gpu

    round_fp8_like_the_gpu()

from kvloom.kernels.fp8_moe_triton import fp8_fused_moe_triton  # noqa: E402
from kvloom.kernels.w4a16_gemm import pack_int4  # noqa: E402
from kvloom.kernels.w4a16_moe_triton import w4a16_fused_moe_triton  # noqa: E402

PLANS = (16, 32, 64)
NAN = float("nan")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def w4a16_moe(num_experts, hidden, inter, dtype, seed, group=32):
    """A launch of the W4A16 MoE on random int4 experts."""
    g = gen(seed)
    packed, scales = [], []
    for shape in ((num_experts, 2 * inter, hidden), (num_experts, hidden, inter)):
        packed.append(pack_int4(torch.randint(-8, 8, shape, generator=g)).to(DEVICE))
        scale = torch.rand(*shape[:-1], shape[-1] // group, generator=g) * 0.05 + 0.005
        scales.append(scale.to(DEVICE, dtype))
    weights = (packed[0], scales[0], packed[1], scales[1], group)

    def launch(x, topk_weights, ids, **kwargs):
        return w4a16_fused_moe_triton(x, *weights, topk_weights, ids, **kwargs)

    return launch


def fp8_moe(num_experts, hidden, inter, seed, g13=64, g2=32):
    """A launch of the FP8 MoE on random e4m3 experts with group scales."""
    g = gen(seed)
    tensors = []
    for rows, cols, group in ((2 * inter, hidden, g13), (hidden, inter, g2)):
        w_q = (torch.randn(num_experts, rows, cols, generator=g) * 40).to(torch.float8_e4m3fn)
        w_s = torch.rand(num_experts, rows, cols // group, generator=g) * 0.004 + 2e-4
        tensors += [w_q.to(DEVICE), w_s.to(DEVICE)]

    def launch(x, topk_weights, ids, **kwargs):
        return fp8_fused_moe_triton(x, *tensors, g13, g2, topk_weights, ids, **kwargs)

    return launch


def routing(num_tokens, num_routed, top_k, seed, shared):
    """Distinct experts per token from a pool of max(3, k), so tokens share experts; with
    `shared`, one more slot routes every token to expert `num_routed`."""
    g = gen(seed)
    pool = torch.randperm(num_routed, generator=g)[: max(3, top_k)]
    ids = pool[torch.rand(num_tokens, pool.numel(), generator=g).argsort(dim=1)[:, :top_k]]
    if shared:
        ids = torch.cat([ids, torch.full((num_tokens, 1), num_routed)], dim=1)
    weights = torch.rand(ids.shape, generator=g) + 0.05
    return weights.to(DEVICE), ids.to(DEVICE, torch.int32)


def assert_pairs_bitwise(label, launch, x, weights, ids):
    pairs = launch(x, weights, ids, pairs=True, _fill=NAN)
    assert not torch.isnan(pairs).any(), f"{label}: NaN (an unwritten element was read)"
    for block_m in PLANS:
        sorted_out = launch(x, weights, ids, block_m=block_m, pairs=False, _fill=NAN)
        assert torch.equal(pairs, sorted_out), f"{label}: pairs differs from block_m={block_m}"
    return pairs


SCHEMES = ["w4a16", "fp8"]


def scheme_launch(scheme, num_experts, hidden, inter, dtype, seed):
    if scheme == "w4a16":
        return w4a16_moe(num_experts, hidden, inter, dtype, seed)
    return fp8_moe(num_experts, hidden, inter, seed)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(("top_k", "shared"), [(1, False), (2, True)])
def test_quantized_pairs_plan_is_bitwise_the_sorted_plans(scheme, top_k, shared):
    num_routed, hidden, inter, dtype = 5, 128, 64, torch.bfloat16
    launch = scheme_launch(scheme, num_routed + shared, hidden, inter, dtype, seed=1)
    for num_tokens in range(1, PAIRS_PLAN_MAX_TOKENS + 2):
        weights, ids = routing(num_tokens, num_routed, top_k, num_tokens, shared)
        x = torch.randn(num_tokens, hidden, generator=gen(50 + num_tokens)).to(DEVICE, dtype)
        label = f"{scheme} T={num_tokens} k={top_k} shared={shared}"
        assert_pairs_bitwise(label, launch, x, weights, ids)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_pairs_plan_drops_out_of_range_ids(scheme):
    num_experts, hidden, inter, dtype = 4, 64, 32, torch.bfloat16
    launch = scheme_launch(scheme, num_experts, hidden, inter, dtype, seed=2)
    weights, ids = routing(3, num_experts, 3, seed=3, shared=False)
    ids[0, 1], ids[1, 0], ids[2, 2] = -1, num_experts, 1000
    x = torch.randn(3, hidden, generator=gen(4)).to(DEVICE, dtype)
    assert_pairs_bitwise(f"{scheme} out-of-range ids", launch, x, weights, ids)


@gpu
@needs_cuda
@pytest.mark.parametrize("scheme", SCHEMES)
def test_gpu_quantized_pairs_plan_at_qwen3_next_shape(scheme):
    """512 routed experts + the folded shared one, top 10 + 1, hidden 2048, inter 512:
    pairs bitwise every sorted plan at T = 1..2x the pairs limit; the automatic choice
    is the pairs plan up to its limit (same bits either way)."""
    launch = scheme_launch(scheme, 513, 2048, 512, torch.bfloat16, seed=5)
    for num_tokens in range(1, 2 * PAIRS_PLAN_MAX_TOKENS + 1):
        g = torch.Generator(device="cuda").manual_seed(num_tokens)
        logits = torch.randn(num_tokens, 512, device="cuda", generator=g)
        weights, ids = torch.softmax(logits, dim=-1).topk(10, dim=-1)
        ids = torch.cat([ids, torch.full_like(ids[:, :1], 512)], dim=1).to(torch.int32)
        weights = torch.cat([weights, torch.sigmoid(logits[:, :1])], dim=1)
        x = torch.randn(num_tokens, 2048, device="cuda", generator=g).to(torch.bfloat16)
        pairs = assert_pairs_bitwise(f"gpu {scheme} T={num_tokens}", launch, x, weights, ids)
        assert torch.equal(launch(x, weights, ids), pairs)
