"""The structured-output mask kernel (`apply_token_bitmask_triton`) against its torch
reference, and the sampler's use of it: one staged copy and one launch for all masked rows
(plain and draft-verification lanes), nothing when no row has a mask.

Without CUDA the kernel runs in Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1) at small shapes, with small blocks so a row spans several programs;
with CUDA the same tests run compiled, and the `gpu`-marked one adds the real shape (256
rows x Qwen's 151,936 vocab, bfloat16) inside a captured CUDA graph. Logits are fresh random
values with NaN and +inf sprinkled (an allowed one must survive unchanged: the kernel only
writes -inf), masks random words, so every comparison is exact.
"""

from __future__ import annotations

import pytest
import torch

from kvloom.contracts.sampling_params import SamplingParams
from kvloom.kernels import ops
from kvloom.kernels.token_bitmask import allowed_tokens, apply_token_bitmask_ref
from kvloom.kernels.token_bitmask_triton import apply_token_bitmask_triton
from kvloom.workers import sampler
from kvloom.workers.sampler import RowSamplingState, apply_lane_bitmasks, apply_token_bitmasks
from tests.kernel_env import DEVICE, gpu, needs_cuda

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def random_logits(rows: int, vocab: int, dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[torch.rand(rows, vocab, generator=gen) < 0.05] = float("nan")
    logits[torch.rand(rows, vocab, generator=gen) < 0.02] = float("inf")
    return logits.to(dtype).to(DEVICE)


def random_bitmask(masks: int, words: int, seed: int, density: float = 0.5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    bits = torch.rand(masks, words, 32, generator=gen) < density
    weights = torch.tensor([1 << j for j in range(32)], dtype=torch.int64)
    words_i64 = (bits.long() * weights).sum(-1)
    return words_i64.to(torch.int32).to(DEVICE)  # wraps bit 31 into the sign, as xgrammar's


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_reference_semantics_by_hand():
    logits = torch.arange(1.0, 71.0).view(1, 70)
    words = torch.tensor([[1 - 2**31, 0]], dtype=torch.int32)  # bits 0 and 31: tokens 0, 31
    apply_token_bitmask_ref(logits, words)
    kept = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert kept == [0, 31] and logits[0, 31] == 32.0
    # Past the mask's width (64 tokens) nothing is allowed; a padding row changes nothing.
    logits = torch.ones(2, 70)
    apply_token_bitmask_ref(
        logits, torch.full((2, 2), -1, dtype=torch.int32), torch.tensor([0, -1])
    )
    assert torch.isinf(logits[0, 64:]).all() and torch.isfinite(logits[0, :64]).all()
    assert torch.isfinite(logits[1]).all()
    assert allowed_tokens(torch.tensor([[5]], dtype=torch.int32), 3).tolist() == [
        [True, False, True]
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "rows,vocab,words,masked",
    [
        (1, 1, 1, None),
        (3, 31, 1, None),
        (2, 64, 2, None),
        (4, 100, 4, [3, 0]),  # a subset, out of order
        (5, 1000, 32, [4, -1, 1]),  # a padding mask
        (3, 2500, 60, None),  # the mask is narrower than the vocab: the rest is disallowed
        (2, 300, 20, [1]),  # wider than the vocab
    ],
)
def test_kernel_matches_reference(dtype, rows, vocab, words, masked):
    seed = rows * 7919 + vocab
    logits = random_logits(rows, vocab, dtype, seed)
    num_masks = rows if masked is None else len(masked)
    bitmask = random_bitmask(num_masks, words, seed)
    index = None if masked is None else torch.tensor(masked, dtype=torch.long, device=DEVICE)
    expect, got = logits.clone(), logits.clone()
    apply_token_bitmask_ref(expect, bitmask, index)
    apply_token_bitmask_triton(got, bitmask, index, _block=128)
    same(got, expect)
    if vocab > 1:  # the mask did something (one token may be allowed by chance)
        assert not torch.equal(expect.isinf(), logits.isinf())


def test_bad_arguments_name_the_field():
    logits = torch.zeros(2, 40, device=DEVICE)
    with pytest.raises(ValueError, match="bitmask: expected an int32"):
        apply_token_bitmask_triton(logits, torch.zeros(2, 2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="bitmask: 1 masks for 2 logits rows"):
        apply_token_bitmask_ref(logits, torch.zeros(1, 2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="rows: one per mask"):
        ops.apply_token_bitmask_(
            logits,
            torch.zeros(1, 2, dtype=torch.int32, device=DEVICE),
            torch.tensor([0, 1], device=DEVICE),
        )
    with pytest.raises(ValueError, match="logits: dtype torch.float64"):
        apply_token_bitmask_triton(
            logits.double(), torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
        )


# -- the sampler ----------------------------------------------------------------------
def _row(mask: torch.Tensor | None) -> RowSamplingState:
    blob = None if mask is None else mask.cpu().numpy().tobytes()
    return RowSamplingState(SamplingParams(), 0, [], [], token_bitmask=blob)


def test_sampler_masks_rows_in_one_launch(monkeypatch):
    vocab, words = 200, 7
    logits = random_logits(4, vocab, torch.float32, 11)
    masks = random_bitmask(4, words, 11)
    rows = [_row(masks[0]), _row(None), _row(masks[2]), _row(masks[3])]
    launches = []
    real = sampler.apply_token_bitmask_
    monkeypatch.setattr(sampler, "apply_token_bitmask_", lambda *a: launches.append(a) or real(*a))
    got = logits.clone()
    apply_token_bitmasks(got, rows)
    expect = logits.clone()
    apply_token_bitmask_ref(expect, masks[[0, 2, 3]], torch.tensor([0, 2, 3], device=DEVICE))
    same(got, expect)
    assert len(launches) == 1
    # No row with a grammar: no copy, no launch.
    untouched = logits.clone()
    apply_token_bitmasks(untouched, [_row(None)] * 4)
    apply_lane_bitmasks(untouched.view(2, 2, vocab), [_row(None)] * 2)
    assert len(launches) == 1
    same(untouched, logits)


def test_lane_masks_go_to_each_rows_own_lanes():
    """Draft verification: row 0 samples 3 lanes, row 1 none (no grammar), row 2 one lane;
    a row's lanes past its masks are padding and stay as they were."""
    vocab, lanes = 90, 3
    words = (vocab + 31) // 32
    logits = random_logits(3 * lanes, vocab, torch.float32, 5).view(3, lanes, vocab)
    masks = random_bitmask(4, words, 5)
    row0 = RowSamplingState(
        SamplingParams(), 0, [], [], token_bitmask=masks[:3].cpu().numpy().tobytes()
    )
    rows = [row0, _row(None), _row(masks[3])]
    got = logits.clone()
    apply_lane_bitmasks(got, rows)
    expect = logits.clone().view(3 * lanes, vocab)
    apply_token_bitmask_ref(expect, masks, torch.tensor([0, 1, 2, 6], device=DEVICE))
    same(got, expect.view(3, lanes, vocab))


def test_greedy_rows_under_grammars_take_the_fused_argmax(monkeypatch):
    """Greedy rows with masks, no logprobs or penalties: the mask on a copy, then the fused
    argmax; the tokens are sanitize-then-argmax's (NaN never wins, a masked-out +inf does
    not either, a row with nothing allowed gives token 0)."""
    vocab = 300
    logits = random_logits(4, vocab, torch.float32, 21)
    masks = random_bitmask(4, (vocab + 31) // 32, 21, density=0.2)
    masks[3] = 0  # nothing allowed
    rows = [_row(masks[0]), _row(None), _row(masks[2]), _row(masks[3])]
    for row in rows:
        row.params = SamplingParams(temperature=0.0)
    calls = []
    real = sampler.greedy_argmax
    monkeypatch.setattr(sampler, "greedy_argmax", lambda x: calls.append(x) or real(x))
    original = logits.clone()
    tokens, logprobs = sampler.sample_on_device(logits, rows, -1)
    assert len(calls) == 1 and logprobs is None
    same(logits, original)  # the caller's logits are not masked
    expect = logits.clone()
    apply_token_bitmask_ref(expect, masks[[0, 2, 3]], torch.tensor([0, 2, 3], device=DEVICE))
    clean, _ = sampler.sanitize_logits(expect, torch.ones(4, dtype=torch.bool, device=DEVICE))
    assert tokens.tolist() == clean.argmax(-1).tolist()
    assert tokens[3] == 0


def test_staging_reuses_its_buffers_and_grows():
    staging = sampler.BitmaskStaging()
    small = [torch.tensor([1, 2], dtype=torch.int32).numpy().tobytes()]
    words, index = staging.stage(small, [0], 2, DEVICE)
    assert words.tolist() == [[1, 2]] and index.tolist() == [0]
    big = [torch.arange(i, i + 3, dtype=torch.int32).numpy().tobytes() for i in range(5)]
    words, index = staging.stage(big, [4, 3, 2, 1, 0], 3, DEVICE)
    assert words[:, 0].tolist() == [0, 1, 2, 3, 4] and index.tolist() == [4, 3, 2, 1, 0]


# ------------------------------------------------------------------------------------- gpu
@gpu
@needs_cuda
def test_gpu_real_shape_and_cuda_graph():
    rows, vocab = 256, 151_936
    words = (vocab + 31) // 32
    logits = random_logits(rows, vocab, torch.bfloat16, 3)
    bitmask = random_bitmask(rows, words, 3, density=0.1)
    index = torch.randperm(rows, device=DEVICE)
    expect = logits.clone()
    apply_token_bitmask_ref(expect, bitmask, index)
    got = logits.clone()
    apply_token_bitmask_triton(got, bitmask, index)
    same(got, expect)
    # Captured once, replayed on new masks written into the same buffers.
    static = logits.clone()
    graph = torch.cuda.CUDAGraph()
    apply_token_bitmask_triton(static, bitmask, index)  # warm-up (compiles)
    static.copy_(logits)
    with torch.cuda.graph(graph):
        apply_token_bitmask_triton(static, bitmask, index)
    bitmask.copy_(random_bitmask(rows, words, 4, density=0.1))
    static.copy_(logits)
    graph.replay()
    expect = logits.clone()
    apply_token_bitmask_ref(expect, bitmask, index)
    same(static, expect)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        apply_token_bitmask_triton(got, bitmask, index)
    end.record()
    torch.cuda.synchronize()
    print(f"TIMING apply_token_bitmask 256x151936 bf16: {start.elapsed_time(end) / 100:.4f} ms")


@gpu
@needs_cuda
def test_gpu_sampler_staging_over_steps():
    """The sampler's pinned staging on CUDA: steps of changing batch size and lane counts
    (slots taking turns and growing) each mask exactly as the reference."""
    vocab = 151_936
    words = (vocab + 31) // 32
    for step, num_rows in enumerate([1, 8, 3, 64, 64, 2, 256, 5]):
        logits = random_logits(num_rows, vocab, torch.bfloat16, 100 + step)
        masks = random_bitmask(num_rows, words, 100 + step, density=0.05)
        rows = [_row(None if i % 3 == 1 else masks[i]) for i in range(num_rows)]
        got = logits.clone()
        apply_token_bitmasks(got, rows)
        masked = [i for i in range(num_rows) if i % 3 != 1]
        expect = logits.clone()
        apply_token_bitmask_ref(expect, masks[masked], torch.tensor(masked, device=DEVICE))
        same(got, expect)
