"""The fused greedy argmax (`greedy_argmax_triton`) against its torch reference and against
the sampler's own path (`sanitize_logits` then `argmax`): all three must agree exactly.

Without CUDA the kernel runs in Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1); with CUDA the same tests run compiled, and the `gpu`-marked one adds
the real shape (1024 rows x Qwen's 151,936 vocab, bfloat16) and a CUDA-graph replay.
Rows are fresh random values with special rows mixed in: NaNs sprinkled, a NaN on the
maximum, several +inf (the first wins), all -inf, all NaN, -inf/NaN only, exact ties
(the smallest index wins) placed across segment boundaries, and a -0.0/+0.0 tie.
The interpreter cases use small segments (`_segment`/`_block`) so a few thousand tokens
already span many segments and both launches; some cases keep the real SEGMENT.
The answers are indices, so every comparison is exact.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kvloom.kernels import ops
from kvloom.kernels.greedy_argmax import greedy_argmax_ref
from kvloom.kernels.greedy_argmax_triton import SEGMENT, greedy_argmax_triton
from kvloom.workers.sampler import sanitize_logits
from tests.kernel_env import DEVICE, gpu, needs_cuda

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NAN, INF = float("nan"), float("inf")
TOP = 100.0  # exact in every dtype and above any of the random logits (|randn * 3| < 40)
SMALL = {"_segment": 512, "_block": 128}  # 4 loads per segment, up to 9 segments a row


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def segment_width(vocab: int, overrides: dict) -> int:
    """The segment the kernel uses for this vocab (a row smaller than it shrinks it)."""
    segment = overrides.get("_segment", SEGMENT)
    return min(segment, 1 << max(0, (vocab - 1).bit_length()))


def special_row(row: torch.Tensor, kind: int, seg: int, gen: torch.Generator) -> int | None:
    """Rewrites one float32 row in place as row kind `kind`; returns the answer the rules
    give directly where the kind fixes it (None where it is whatever the random max is)."""
    vocab = row.shape[0]

    def positions(count: int) -> list[int]:
        return torch.randint(0, vocab, (count,), generator=gen).tolist()

    def sprinkle(value: float, fraction: float) -> None:
        row[torch.rand(vocab, generator=gen) < fraction] = value

    if kind == 0:  # plain random
        return None
    if kind == 1:  # NaNs sprinkled: they never win
        sprinkle(NAN, 0.2)
        return None
    if kind == 2:  # NaN on the maximum (and a few elsewhere): the runner-up wins
        row[row.argmax()] = NAN
        row[positions(3)] = NAN
        return None
    if kind == 3:  # several +inf among NaN and -inf: the first +inf wins
        sprinkle(NAN, 0.1)
        sprinkle(-INF, 0.1)
        at = positions(4)
        row[at] = INF
        return min(at)
    if kind == 4:
        row.fill_(-INF)
        return 0
    if kind == 5:
        row.fill_(NAN)
        return 0
    if kind == 6:  # only -inf and NaN: nothing selectable, token 0
        row.fill_(-INF)
        sprinkle(NAN, 0.5)
        return 0
    if kind == 7:  # exact ties straddling segment boundaries: the smallest index wins
        at = [p % vocab for p in (seg - 1, seg, 2 * seg + 3, vocab - 1, *positions(2))]
        row[at] = TOP
        return min(at)
    if kind == 8:  # NaNs before a lone +inf at the very end
        sprinkle(NAN, 0.3)
        row[vocab - 1] = INF
        return vocab - 1
    if kind == 9:  # -inf sprinkled, ties of the max at random places, a NaN among them
        sprinkle(-INF, 0.3)
        at = positions(5)
        row[at] = TOP
        row[at[0]] = NAN
        rest = [p for p in at if p != at[0]]
        return min(rest) if rest else None
    if kind == 10:  # -0.0 and +0.0 tie as the maximum: equal values, the first wins
        row.copy_(-(row.abs() + 1.0))
        low, high = sorted(positions(2))
        row[high] = 0.0
        row[low] = -0.0
        return low
    if kind == 11:  # a NaN before the first +inf, a second +inf after it
        first = int(torch.randint(0, vocab, (1,), generator=gen))
        row[:first] = NAN
        row[first] = INF
        row[min(first + seg, vocab - 1)] = INF
        return first
    raise AssertionError(kind)


NUM_KINDS = 12


def make_case(rows, vocab, dtype, seed, seg, wide=0):
    """Logits [rows, vocab] (a slice of a [rows, vocab + wide] tensor when wide > 0) and,
    per row, the directly known answer or None."""
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(rows, vocab + wide, generator=gen) * 3.0
    x = full[:, wide // 2 : wide // 2 + vocab]
    known = [special_row(x[r], (r + seed) % NUM_KINDS, seg, gen) for r in range(rows)]
    logits = full.to(device=DEVICE, dtype=dtype)[:, wide // 2 : wide // 2 + vocab]
    return logits, known


def sampler_path(logits: torch.Tensor) -> torch.Tensor:
    """What workers/sampler.py::sample_on_device does for greedy rows today."""
    real = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    clean, _ = sanitize_logits(logits.float(), real)
    return clean.argmax(-1)


def check_case(name, logits, known, **overrides):
    got = greedy_argmax_triton(logits, **overrides)
    want = greedy_argmax_ref(logits)
    assert got.dtype == torch.int64 and got.shape == (logits.shape[0],), (name, got)
    assert got.device == logits.device, name
    assert torch.equal(want, sampler_path(logits)), f"{name}: reference != sampler path"
    assert torch.equal(got, want), f"{name}: triton {got.tolist()} != ref {want.tolist()}"
    for r, answer in enumerate(known):
        if answer is not None:
            assert int(want[r]) == answer, (name, r, answer, int(want[r]))


VOCABS_SMALL_SEG = (1, 7, 4095, 4096, 4097, 3 * SMALL["_segment"] + 5)


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("vocab", VOCABS_SMALL_SEG)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference_small_segments(dtype, vocab, rows):
    seg = segment_width(vocab, SMALL)
    logits, known = make_case(rows, vocab, dtype, seed_of(dtype, vocab, rows), seg)
    check_case(f"{dtype} V{vocab} R{rows}", logits, known, **SMALL)


@pytest.mark.parametrize(
    "vocab,rows",
    [(7, 17), (4095, 17), (4096, 3), (4097, 17), (3 * SEGMENT + 5, 17), (5 * SEGMENT - 1, 3)],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference_real_segment(dtype, vocab, rows):
    seg = segment_width(vocab, {})
    logits, known = make_case(rows, vocab, dtype, seed_of("real", dtype, vocab, rows), seg)
    check_case(f"real {dtype} V{vocab} R{rows}", logits, known)


@pytest.mark.parametrize("overrides", [SMALL, {}], ids=["small", "real"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_rows(dtype, overrides):
    """A column slice of a wider tensor: row stride vocab + 40, data offset 20."""
    vocab = 3 * segment_width(10**9, overrides) + 5
    seg = segment_width(vocab, overrides)
    logits, known = make_case(17, vocab, dtype, seed_of("wide", dtype, vocab), seg, wide=40)
    assert logits.stride(0) == vocab + 40 and not logits.is_contiguous()
    check_case(f"strided {dtype} V{vocab}", logits, known, **overrides)


def test_rows_do_not_depend_on_the_batch():
    logits, _ = make_case(17, 1000, torch.bfloat16, seed_of("batch"), segment_width(1000, SMALL))
    together = greedy_argmax_triton(logits, **SMALL)
    alone = torch.cat([greedy_argmax_triton(logits[r : r + 1], **SMALL) for r in range(17)])
    assert torch.equal(together, alone)
    assert torch.equal(together, greedy_argmax_ref(logits))


def test_fold_spans_several_chunks():
    """More segments than one pass-2 load (FOLD_BLOCK): ties across those chunks."""
    vocab = 2 * 64 * 8 + 3  # 8-token segments -> 2 * 64 + 1 segments
    gen = torch.Generator().manual_seed(seed_of("fold"))
    x = torch.randn(3, vocab, generator=gen)
    x[0, [vocab - 1, 8 * 64 + 1, 8 * 64 - 1]] = TOP  # the winner ends the first chunk
    x[1, [vocab - 1, 2 * 8 * 64]] = TOP  # the winner is in the last segment
    x[2, 8 * 64 + 1 :] = INF  # +inf fills the later chunks; the first one wins
    x = x.to(DEVICE)
    got = greedy_argmax_triton(x, _segment=8, _block=4)
    assert got.tolist() == [8 * 64 - 1, 2 * 8 * 64, 8 * 64 + 1]
    assert torch.equal(got, greedy_argmax_ref(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_batch(dtype):
    logits = torch.randn(0, 4097).to(device=DEVICE, dtype=dtype)
    for fn in (greedy_argmax_triton, greedy_argmax_ref, ops.greedy_argmax):
        out = fn(logits)
        assert out.shape == (0,) and out.dtype == torch.int64 and out.device == logits.device


def test_dispatcher_matches_reference():
    """ops.greedy_argmax: Triton on CUDA, the reference elsewhere (float64 always)."""
    for dtype in (*DTYPES, torch.float64):
        logits, known = make_case(17, 300, dtype, seed_of("ops", dtype), 300)
        got = ops.greedy_argmax(logits)
        assert torch.equal(got, greedy_argmax_ref(logits)), dtype
        assert torch.equal(got, sampler_path(logits)), dtype


BAD_LOGITS = {
    "1-D": lambda: torch.randn(8),
    "3-D": lambda: torch.randn(2, 3, 8),
    "int": lambda: torch.randint(0, 9, (2, 8)),
    "bool": lambda: torch.ones(2, 8, dtype=torch.bool),
    "empty vocab": lambda: torch.randn(2, 0),
    "not a tensor": lambda: [[1.0, 2.0]],
}


@pytest.mark.parametrize("fn", [greedy_argmax_triton, greedy_argmax_ref, ops.greedy_argmax])
@pytest.mark.parametrize("case", sorted(BAD_LOGITS))
def test_bad_logits_name_the_field(case, fn):
    bad = BAD_LOGITS[case]()
    if isinstance(bad, torch.Tensor):
        bad = bad.to(DEVICE)
    with pytest.raises(ValueError, match="logits"):
        fn(bad)


def test_triton_rejects_what_it_cannot_read():
    base = torch.randn(4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="logits"):
        greedy_argmax_triton(base[:, ::2])  # column stride 2
    with pytest.raises(ValueError, match="logits"):
        greedy_argmax_triton(base.double())
    with pytest.raises(ValueError, match="_segment"):
        greedy_argmax_triton(base, _segment=48)


# ------------------------------------------------------------------------------------- gpu


@gpu
@needs_cuda
def test_gpu_real_shape_and_cuda_graph():
    rows, vocab = 1024, 151936
    logits, known = make_case(rows, vocab, torch.bfloat16, seed_of("gpu"), SEGMENT)
    check_case("gpu R1024 V151936 bf16", logits, known)

    # Capture on a static input, refill it in place, replay: equal to eager on the new values.
    static = logits.contiguous()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = greedy_argmax_triton(static)
    fresh, _ = make_case(rows, vocab, torch.bfloat16, seed_of("gpu", "fresh"), SEGMENT)
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, greedy_argmax_ref(fresh))
