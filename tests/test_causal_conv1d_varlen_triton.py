"""The packed-sequence (prefill) causal conv kernel against the pure-torch reference, on
fresh random inputs: interpreted on the CPU (the root conftest sets TRITON_INTERPRET=1) at
small shapes, compiled on a GPU, where the `gpu` test adds Qwen3-Next's conv width.

Sequences of every kind share a launch: empty, shorter than the conv's K-1 history, one
token, long, with and without a carried state (rows without one hold NaN, as a recycled
slot does under the sanitizer, and must not leak). The final states are pure data
movement, so they must equal the reference's exactly; outputs differ only in the order of
K float32 products (f32: ~1e-6), then one rounding for bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from kvloom.kernels.causal_conv1d import causal_conv1d_varlen
from kvloom.kernels.causal_conv1d_triton import causal_conv1d_varlen_triton
from tests.kernel_env import DEVICE, gpu

OUT_TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (1.6e-2, 1.6e-2)}


def case(lens, channels, width, dtype, with_state, gen):
    x = torch.randn(sum(lens), channels, generator=gen).to(dtype=dtype, device=DEVICE)
    weight = torch.randn(channels, width, generator=gen).to(dtype=dtype, device=DEVICE)
    bias = torch.randn(channels, generator=gen).to(dtype=dtype, device=DEVICE)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    state = has = None
    if with_state:
        state = torch.randn(len(lens), channels, width - 1, generator=gen).to(DEVICE)
        has = torch.tensor([i % 3 != 1 for i in range(len(lens))], device=DEVICE)
        state[~has] = float("nan")  # a fresh row's slot: never read
    return x, weight, bias, cu.to(DEVICE), state, has


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("with_state", [True, False], ids=["state", "fresh"])
@pytest.mark.parametrize("activation", ["silu", None])
def test_varlen_conv_matches_the_reference(dtype, with_state, activation):
    gen = torch.Generator().manual_seed(3)
    # Empty, shorter than K-1, one token, long (several token blocks), exactly K-1.
    lens = [5, 0, 2, 1, 37, 3, 0, 19]
    x, weight, bias, cu, state, has = case(lens, 160, 4, dtype, with_state, gen)
    for b in (bias, None):
        want_y, want_state = causal_conv1d_varlen(x, weight, b, cu, state, has, activation)
        got_y, got_state = causal_conv1d_varlen_triton(x, weight, b, cu, state, has, activation)
        assert got_y.dtype == x.dtype and got_state.dtype == want_state.dtype
        torch.testing.assert_close(got_y, want_y, atol=OUT_TOL[dtype][0], rtol=OUT_TOL[dtype][1])
        assert torch.equal(got_state, want_state)
        assert torch.isfinite(got_y).all() and torch.isfinite(got_state).all()


def test_varlen_conv_finds_rows_and_states_in_the_kernel():
    """The launch finds each token's row itself (binary search over the bounds) and stores
    the new states in the same launch: many rows (not a power of two), runs of empty rows,
    rows shorter than K-1 with and without a state, and padding tokens past the last row
    (a CUDA graph's), against the reference; the states bitwise, a float32 state beside
    bf16 inputs."""
    gen = torch.Generator().manual_seed(7)
    lens = [0, 0, 3, 1, 0, 2, 17, 0, 0, 0, 1, 5, 2, 33, 1, 0, 4, 2, 1, 9, 0]
    x, weight, bias, cu, state, has = case(lens, 136, 4, torch.bfloat16, True, gen)
    padded = torch.cat([x, torch.randn(11, 136, generator=gen).to(x)])
    want_y, want_state = causal_conv1d_varlen(x, weight, bias, cu, state, has)
    got_y, got_state = causal_conv1d_varlen_triton(padded, weight, bias, cu.cpu(), state, has)
    torch.testing.assert_close(got_y[: x.shape[0]], want_y, atol=1.6e-2, rtol=1.6e-2)
    assert got_state.dtype == torch.float32 and torch.equal(got_state, want_state)
    fresh_y, fresh_state = causal_conv1d_varlen_triton(x, weight, None, cu, None, None)
    want_fresh = causal_conv1d_varlen(x, weight, None, cu, None, None)
    torch.testing.assert_close(fresh_y, want_fresh[0], atol=1.6e-2, rtol=1.6e-2)
    assert torch.equal(fresh_state, want_fresh[1])


def test_varlen_conv_edge_launches():
    gen = torch.Generator().manual_seed(4)
    # No tokens at all (every sequence empty): the state carries over unchanged.
    x, weight, bias, cu, state, has = case([0, 0], 8, 4, torch.float32, True, gen)
    y, new = causal_conv1d_varlen_triton(x, weight, bias, cu, state, has)
    assert y.shape == (0, 8)
    assert torch.equal(new[has], state[has]) and torch.equal(new[~has], torch.zeros_like(new[~has]))
    # Width 1: no history at all.
    x, weight, bias, cu, _, _ = case([3, 2], 8, 1, torch.float32, False, gen)
    want = causal_conv1d_varlen(x, weight, bias, cu, None, None)
    got = causal_conv1d_varlen_triton(x, weight, bias, cu, None, None)
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1], want[1]) and got[1].shape == (2, 8, 0)


def test_varlen_conv_bad_input_names_the_field():
    gen = torch.Generator().manual_seed(5)
    x, weight, bias, cu, state, has = case([3, 2], 8, 4, torch.float32, True, gen)
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d_varlen_triton(x, weight[:4], bias, cu, state, has)
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_varlen_triton(x, weight, bias, cu, state[:, :4], has)
    with pytest.raises(ValueError, match="has_initial_state"):
        causal_conv1d_varlen_triton(x, weight, bias, cu, state, None)
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d_varlen_triton(x, weight, bias, cu.float(), state, has)


@gpu
def test_gpu_varlen_conv_qwen3_next_width():
    """Qwen3-Next's conv (K = 4, 8192 channels) over an 8192-token step of mixed rows."""
    gen = torch.Generator().manual_seed(6)
    lens = [4096, 1, 2, 3000, 0, 1093]
    x, weight, bias, cu, state, has = case(lens, 8192, 4, torch.bfloat16, True, gen)
    want_y, want_state = causal_conv1d_varlen(x, weight, None, cu, state, has)
    # The layers hand the chunk bounds over on the host (workers/linear_rows.py).
    for bounds in (cu, cu.cpu()):
        got_y, got_state = causal_conv1d_varlen_triton(x, weight, None, bounds, state, has)
        torch.testing.assert_close(got_y, want_y, atol=1.6e-2, rtol=1.6e-2)
        assert torch.equal(got_state, want_state)


@pytest.mark.parametrize("arch", ["qwen3_next", "kimi_linear"])
def test_layers_serve_prefill_through_the_kernel(hybrid_model, arch, monkeypatch):
    """The layers' own call (chunk bounds on the host, gathered states, fresh and resumed
    rows, chunked prefill and preemption), with the kernel in place of the reference as
    CUDA takes it: the same greedy tokens (float32)."""
    from kvloom import Engine
    from kvloom.workers.layers import gated_deltanet, kda_layer
    from tests.engine_helpers import PROMPTS, assert_pool_full, greedy, run_to_completion

    settings = dict(dtype="float32", device="cpu", block_size=4, max_num_seqs=8,
                    max_num_batched_tokens=24, num_kv_blocks=64, sanitize=True, progress=False)  # fmt: skip
    path = str(hybrid_model(arch))
    want = run_to_completion(Engine(model=path, **settings), PROMPTS, greedy(10))
    calls = []

    def kernel(*args):
        calls.append(1)
        return causal_conv1d_varlen_triton(*args)

    monkeypatch.setattr(gated_deltanet, "causal_conv1d_varlen", kernel)
    monkeypatch.setattr(kda_layer, "causal_conv1d_varlen", kernel)
    eng = Engine(model=path, **settings)
    got = run_to_completion(eng, PROMPTS, greedy(10))
    assert calls and eng.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert_pool_full(eng)
