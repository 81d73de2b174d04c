"""The q/k RMSNorm + rotary kernel with its paged-cache write epilogue
(`qk_norm_rope_kv_write_triton`) against the two launches it replaces
(`qk_norm_rope_triton`, then `write_kv_cache_triton` of its keys and the values): bitwise the
same q, k and cache bytes, in bf16/fp16/float32 caches and FP8 caches with per-tensor
scales, with padding slots (-1), partial rotary (Qwen3-Next), GQA, rotary only (Llama) and
the slots of one DCP rank. Also against the torch references, and the ops dispatch.

Without CUDA the kernels run in Triton's CPU interpreter (the conftest sets
TRITON_INTERPRET=1 and makes it round bf16 and fp8 as the GPU does) at small shapes; with
CUDA the same tests run compiled, and the `gpu`-marked ones add the Qwen3-8B and
Qwen3-Next attention shapes and a CUDA-graph replay. Pages never written hold NaN bytes
(the sanitizer's fill), so a write to a wrong slot shows up.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvloom.kernels import ops
from kvloom.kernels import qk_norm_rope_triton as qr
from kvloom.kernels.kv_cache_write import FP8_DTYPE, quantize_kv
from kvloom.kernels.kv_cache_write_triton import write_kv_cache_triton
from kvloom.kernels.qk_norm_rope import qk_norm_rope_kv_write_ref, qk_norm_rope_ref
from kvloom.kernels.qk_norm_rope_triton import qk_norm_rope_kv_write_triton, qk_norm_rope_triton
from kvloom.workers.batch_arrays import slot_mapping as dcp_slot_mapping
from tests.kernel_env import CUDA, DEVICE, gpu, needs_cuda
from tests.test_qk_norm_rope import assert_matches, make_case, seed_of

pytestmark = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
    reason="triton was imported for the compiler first and there is no GPU",
)

BLOCK_SIZE = 4
NUM_BLOCKS = 5
NAN_BYTE = 0xFF  # NaN in bf16/fp16/fp32 high bytes and in e4m3


def nan_cache(num_kv_heads, dim, dtype, num_blocks=NUM_BLOCKS):
    """[2, blocks, block, Hkv, D] laid out as the model runner's page view (key/value
    inside each page, so the key/value stride is below the block stride), NaN bytes."""
    row_bytes = dim * torch.empty(0, dtype=dtype).element_size()
    shape = (num_blocks, 2, BLOCK_SIZE, num_kv_heads, row_bytes)
    pages = torch.full(shape, NAN_BYTE, dtype=torch.uint8, device=DEVICE)
    return pages.view(dtype).transpose(0, 1)


def cache_bytes(cache):
    return cache.contiguous().view(torch.uint8).cpu()


def split_v(qkv, q_heads, k_heads, dim):
    """v as the layers pass it: the last Hk * D columns of the fused projection as heads."""
    return qkv[:, (q_heads + k_heads) * dim :].view(qkv.shape[0], k_heads, dim)


def random_slots(tokens, seed, pad_last):
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:tokens]
    if pad_last:
        slots[-1] = -1  # a padding token writes nothing
    return slots.to(DEVICE)


def two_launches(args, v, cache, slots, k_scale, v_scale):
    q_out, k_out = qk_norm_rope_triton(*args)
    write_kv_cache_triton(k_out, v, cache, slots, k_scale, v_scale)
    return q_out, k_out


def fused(args, v, cache, slots, k_scale, v_scale):
    q, k, positions, *rest = args
    return qk_norm_rope_kv_write_triton(q, k, v, positions, *rest, cache, slots, k_scale, v_scale)


def check_fused_equals_two_launches(name, args, v, cache_dtype, slots, k_scale, v_scale):
    """Runs both on fresh NaN caches; asserts bitwise equality; returns the fused results."""
    k_heads, dim = args[1].shape[1:]
    fused_cache, split_cache = (
        nan_cache(k_heads, dim, cache_dtype),
        nan_cache(k_heads, dim, cache_dtype),
    )
    q_f, k_f = fused(args, v, fused_cache, slots, k_scale, v_scale)
    q_s, k_s = two_launches(args, v, split_cache, slots, k_scale, v_scale)
    assert torch.equal(q_f, q_s), f"{name}: q differs from the two launches'"
    assert torch.equal(k_f, k_s), f"{name}: k differs from the two launches'"
    assert torch.equal(cache_bytes(fused_cache), cache_bytes(split_cache)), f"{name}: cache bytes"
    return q_f, k_f, fused_cache


def check_cache_contents(name, cache, k_out, v, slots, k_scale, v_scale):
    """The written slots hold quantize_kv(k_out) / quantize_kv(v) bit for bit (torch's
    conversion); every other slot still holds NaN bytes."""
    flat = cache.flatten(1, 2)  # [2, slots, Hkv, D]
    valid = slots >= 0
    written = slots[valid].long()
    want_k = quantize_kv(k_out[valid], cache.dtype, k_scale)
    want_v = quantize_kv(v[valid], cache.dtype, v_scale)
    for kv, want in ((0, want_k), (1, want_v)):
        got = flat[kv, written].contiguous().view(torch.uint8)
        assert torch.equal(got, want.contiguous().view(torch.uint8)), f"{name}: cache[{kv}]"
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=flat.device)
    untouched[written] = False
    rest = flat[:, untouched].contiguous().view(torch.uint8)
    assert (rest == NAN_BYTE).all(), f"{name}: a slot outside slot_mapping was written"


# tokens, q_heads, k_heads, dim, rotary_dim, norm (None: rotary only), dtype, cache dtype
CASES = [
    (1, 4, 2, 64, 64, 0.0, torch.bfloat16, torch.bfloat16),  # Qwen3 decode
    (2, 8, 1, 80, 20, 1.0, torch.bfloat16, FP8_DTYPE),  # Qwen3-Next: partial, (1 + w)
    (5, 4, 2, 64, 64, None, torch.float16, torch.float16),  # Llama: rotary only
    (5, 4, 2, 128, 32, 1.0, torch.float16, FP8_DTYPE),
    (3, 4, 4, 32, 32, 0.0, torch.float32, torch.float32),  # MHA, float32
    (3, 8, 2, 64, 16, None, torch.bfloat16, FP8_DTYPE),
]


@pytest.mark.parametrize("tokens,q_heads,k_heads,dim,rot,norm,dtype,cache_dtype", CASES)
def test_fused_write_equals_two_launches(
    tokens, q_heads, k_heads, dim, rot, norm, dtype, cache_dtype
):
    case = (tokens, q_heads, k_heads, dim, rot, norm, dtype)
    name = f"T{tokens} h{q_heads}/{k_heads} d{dim} r{rot} n{norm} {dtype} cache {cache_dtype}"
    qkv, args = make_case(*case, seed=seed_of(*case, cache_dtype))
    v = split_v(qkv, q_heads, k_heads, dim)
    if cache_dtype == FP8_DTYPE:
        v[0, 0, 1] = float("nan")  # stays NaN in the cache
        scales = (0.5, 0.01)  # |v| > 4.48 saturates to 448
    else:
        scales = (1.0, 1.0)
    slots = random_slots(tokens, seed_of(*case, "slots"), pad_last=tokens >= 3)
    before = qkv.clone()
    q_out, k_out, cache = check_fused_equals_two_launches(
        name, args, v, cache_dtype, slots, *scales
    )
    assert torch.equal(qkv.isnan(), before.isnan())
    assert torch.equal(qkv.nan_to_num(), before.nan_to_num()), f"{name}: inputs were written"
    check_cache_contents(name, cache, k_out, v, slots, *scales)

    # Against the torch references: q and k as tests/test_qk_norm_rope.py holds them.
    q, k, positions, *rest = args
    ref_cache = nan_cache(k_heads, dim, cache_dtype)
    ref_q, ref_k = qk_norm_rope_kv_write_ref(q, k, v, positions, *rest, ref_cache, slots, *scales)
    assert_matches(f"{name} q", q_out, ref_q)
    assert_matches(f"{name} k", k_out, ref_k)
    assert torch.equal(cache_bytes(ref_cache)[1], cache_bytes(cache)[1]), f"{name}: values"


def test_padding_only_step_writes_nothing():
    """A decode graph's padding row (slot -1) leaves the cache untouched."""
    qkv, args = make_case(1, 4, 2, 64, 64, 0.0, torch.bfloat16, seed=21)
    slots = torch.full((1,), -1, dtype=torch.int64, device=DEVICE)
    cache = nan_cache(2, 64, torch.bfloat16)
    fused(args, split_v(qkv, 4, 2, 64), cache, slots, 1.0, 1.0)
    assert (cache_bytes(cache) == NAN_BYTE).all()


@pytest.mark.parametrize("rank", [0, 1])
def test_dcp_rank_writes_only_its_positions(rank):
    """Under DCP = 2 the slots (workers/batch_arrays.slot_mapping) are -1 for positions
    the other rank caches; the fused launch writes exactly this rank's, at local slots."""
    tokens, dcp = 6, 2
    qkv, args = make_case(tokens, 4, 2, 32, 32, 1.0, torch.bfloat16, seed=22 + rank)
    positions = torch.arange(3, 3 + tokens)
    args = args[:2] + (positions.to(DEVICE),) + args[3:]
    table = np.array([[3, 1, 4]], dtype=np.int32)  # one request's blocks of the whole cache
    slots = dcp_slot_mapping(
        table, BLOCK_SIZE * dcp, positions.numpy(), np.zeros(tokens, np.int64), dcp, rank
    )
    slots = torch.from_numpy(slots).to(DEVICE)
    assert ((slots >= 0).cpu() == (positions % dcp == rank)).all()
    v = split_v(qkv, 4, 2, 32)
    _, k_out, cache = check_fused_equals_two_launches(
        f"dcp rank {rank}", args, v, torch.bfloat16, slots, 1.0, 1.0
    )
    check_cache_contents(f"dcp rank {rank}", cache, k_out, v, slots, 1.0, 1.0)


def test_int32_slots_and_contiguous_inputs():
    qkv, args = make_case(3, 4, 2, 64, 32, 0.0, torch.float16, seed=23)
    args = (args[0].contiguous(), args[1].contiguous(), args[2].to(torch.int32), *args[3:])
    v = split_v(qkv, 4, 2, 64).contiguous()
    slots = random_slots(3, 24, pad_last=False).to(torch.int32)
    check_fused_equals_two_launches("int32", args, v, torch.float16, slots, 1.0, 1.0)


# (argument that is wrong, how to break the good (v, cache, slots, k_scale, v_scale))
BAD_CACHE_ARGS = [
    ("key/value", lambda v, c, s, ks, vs: (v[:, :1], c, s, ks, vs)),
    ("kv_cache", lambda v, c, s, ks, vs: (v, c[:, :, :, :1], s, ks, vs)),
    ("kv_cache", lambda v, c, s, ks, vs: (v, c.double(), s, ks, vs)),
    ("slot_mapping", lambda v, c, s, ks, vs: (v, c, s[:1], ks, vs)),
    ("slot_mapping", lambda v, c, s, ks, vs: (v, c, s.float(), ks, vs)),
    ("k_scale", lambda v, c, s, ks, vs: (v, c, s, 0.0, vs)),
    ("v_scale", lambda v, c, s, ks, vs: (v, c, s, ks, float("inf"))),
]


@pytest.mark.parametrize("field,breaker", BAD_CACHE_ARGS)
def test_bad_cache_arguments_name_the_field(field, breaker):
    qkv, args = make_case(3, 4, 2, 16, 8, 0.0, torch.float32, seed=25)
    good = (
        split_v(qkv, 4, 2, 16),
        nan_cache(2, 16, torch.float32),
        random_slots(3, 26, False),
        1.0,
        1.0,
    )
    fused(args, *good)  # the unbroken arguments are fine
    with pytest.raises(ValueError, match=f"^{field}:"):
        fused(args, *breaker(*good))


# ------------------------------------------------------------------------------ dispatch


def record_kernels(monkeypatch) -> list[str]:
    """Makes ops take its CUDA paths on these (CPU, interpreted) tensors and records which
    Triton entry points run."""
    import kvloom.kernels.kv_cache_write_triton as write_mod
    import kvloom.kernels.qk_norm_rope_triton as rope_mod

    calls: list[str] = []
    monkeypatch.setattr(ops, "use_triton", lambda t: t.dtype in ops.TRITON_DTYPES)
    for mod, name in (
        (rope_mod, "qk_norm_rope_kv_write_triton"),
        (rope_mod, "qk_norm_rope_triton"),
        (write_mod, "write_kv_cache_triton"),
    ):
        fn = getattr(mod, name)
        monkeypatch.setattr(
            mod, name, lambda *a, _fn=fn, _name=name, **kw: (calls.append(_name), _fn(*a, **kw))[1]
        )
    return calls


@pytest.mark.parametrize(
    "tokens,dtype,cache_dtype,deterministic,fuses",
    [
        (1, torch.bfloat16, torch.bfloat16, False, True),
        (2, torch.float16, FP8_DTYPE, False, True),
        (3, torch.bfloat16, torch.bfloat16, False, False),  # past GEMV_DISPATCH_MAX_M rows
        (1, torch.float32, torch.float32, False, False),  # half precision only
        (1, torch.bfloat16, torch.float32, False, False),  # a cache the kernels do not take
        (1, torch.bfloat16, torch.bfloat16, True, False),  # the deterministic mode
    ],
)
def test_ops_fuses_only_at_decode(monkeypatch, tokens, dtype, cache_dtype, deterministic, fuses):
    """ops.qk_norm_rope_try_kv_write: one launch that also writes the cache where the
    decode fusion applies; elsewhere the norm + rotary only (written False: PagedAttention
    then writes, as before). q, k and the cache are the same bits either way."""
    from kvloom.kernels import dispatch

    calls = record_kernels(monkeypatch)
    monkeypatch.setattr(dispatch, "_batch_invariant", deterministic)
    qkv, args = make_case(tokens, 4, 2, 32, 16, 1.0, dtype, seed=27)
    q, k, positions, *rest = args
    v = split_v(qkv, 4, 2, 32)
    slots = random_slots(tokens, 28, pad_last=False)
    cache = nan_cache(2, 32, cache_dtype)
    q_out, k_out, written = ops.qk_norm_rope_try_kv_write(q, k, v, positions, *rest, cache, slots)
    assert written == fuses
    if fuses:
        assert calls == ["qk_norm_rope_kv_write_triton"], calls
    else:
        assert calls == ["qk_norm_rope_triton"], calls
        assert (cache_bytes(cache) == NAN_BYTE).all(), "the cache was written"
        ops.write_kv_cache(k_out, v, cache, slots)  # the layer's separate write

    calls.clear()  # forced unfused: the two launches, for the bitwise comparison
    monkeypatch.setattr(ops, "_decode_fusion", lambda x: False)
    split_cache = nan_cache(2, 32, cache_dtype)
    split_q, split_k, written = ops.qk_norm_rope_try_kv_write(
        q, k, v, positions, *rest, split_cache, slots
    )
    assert not written and calls == ["qk_norm_rope_triton"]
    ops.write_kv_cache(split_k, v, split_cache, slots)
    assert torch.equal(q_out, split_q) and torch.equal(k_out, split_k)
    assert torch.equal(cache_bytes(cache), cache_bytes(split_cache))


def test_ops_reference_path_on_cpu():
    """Without the Triton path (CPU tensors) the op is the norm + rotary reference and
    leaves the cache to the layer's write, as before."""
    if CUDA:
        pytest.skip("CPU dispatch")
    qkv, args = make_case(2, 4, 2, 32, 16, 1.0, torch.bfloat16, seed=29)
    q, k, positions, *rest = args
    v = split_v(qkv, 4, 2, 32)
    slots = random_slots(2, 30, pad_last=True)
    cache = nan_cache(2, 32, torch.bfloat16)
    got_q, got_k, written = ops.qk_norm_rope_try_kv_write(q, k, v, positions, *rest, cache, slots)
    want_q, want_k = qk_norm_rope_ref(q, k, positions, *rest)
    assert not written and (cache_bytes(cache) == NAN_BYTE).all()
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


# ------------------------------------------------------------------------------------- gpu

GPU_SHAPES = {
    # (q_heads, k_heads, head_dim, rotary_dim, weight_offset)
    "qwen3_8b": (32, 8, 128, 128, 0.0),
    "qwen3_next": (16, 2, 256, 64, 1.0),
    "llama3_8b": (32, 8, 128, 128, None),
}


@gpu
@needs_cuda
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("model", sorted(GPU_SHAPES))
def test_gpu_real_shapes_and_cuda_graph(model, tokens, cache_dtype):
    q_heads, k_heads, dim, rotary_dim, offset = GPU_SHAPES[model]
    case = (tokens, q_heads, k_heads, dim, rotary_dim, offset, torch.bfloat16)
    qkv, args = make_case(*case, seed=seed_of(model, tokens), max_pos=40960)
    v = split_v(qkv, q_heads, k_heads, dim)
    scales = (0.5, 0.25) if cache_dtype == FP8_DTYPE else (1.0, 1.0)
    slots = random_slots(tokens, seed_of(model, "slots"), pad_last=tokens == 2)
    name = f"gpu {model} T{tokens} {cache_dtype}"
    _, k_out, _ = check_fused_equals_two_launches(name, args, v, cache_dtype, slots, *scales)

    # Capture on static inputs, refill them in place, replay: equal to the two launches.
    cache = nan_cache(k_heads, dim, cache_dtype)
    fused(args, v, cache, slots, *scales)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_q, graph_k = fused(args, v, cache, slots, *scales)
    fresh_qkv, fresh_args = make_case(*case, seed=seed_of(model, tokens, "fresh"), max_pos=40960)
    qkv.copy_(fresh_qkv)
    args[2].copy_(fresh_args[2])
    slots.copy_(random_slots(tokens, seed_of(model, "fresh slots"), pad_last=False))
    cache.view(torch.uint8).fill_(NAN_BYTE)
    graph.replay()
    torch.cuda.synchronize()
    want_cache = nan_cache(k_heads, dim, cache_dtype)
    want_q, want_k = two_launches(args, v, want_cache, slots, *scales)
    assert torch.equal(graph_q, want_q) and torch.equal(graph_k, want_k)
    assert torch.equal(cache_bytes(cache), cache_bytes(want_cache))
    check_cache_contents(f"{name} replay", cache, graph_k, v, slots, *scales)


def run_with_tokens_per_program(monkeypatch, per_program, args, v, cache_dtype, slots):
    """The fused launch (and the plain one) with `per_program` tokens a program from the
    first token on (1: one token a program at any size)."""
    monkeypatch.setattr(qr, "tokens_per_program", lambda num_tokens: per_program)
    cache = nan_cache(args[1].shape[1], args[1].shape[2], cache_dtype, num_blocks=16)
    q_out, k_out = fused(args, v, cache, slots, 1.0, 1.0)
    plain = qk_norm_rope_triton(*args)
    return q_out, k_out, cache_bytes(cache), plain


@pytest.mark.parametrize("per_program", [3, 8])
@pytest.mark.parametrize("tokens", [5, 17])
def test_many_tokens_a_program_give_the_same_bits(monkeypatch, per_program, tokens):
    """Prefill sizes run several tokens of a head per program (the last program redoes
    the last token where the count does not divide): q, k and the cache bytes are those
    of one token a program, bit for bit, and every slot is written once as before."""
    case = (tokens, 4, 2, 64, 64, 0.0, torch.bfloat16)
    qkv, args = make_case(*case, seed=seed_of("per program", tokens))
    v = split_v(qkv, 4, 2, 64)
    gen = torch.Generator().manual_seed(tokens)
    slots = torch.randperm(16 * BLOCK_SIZE, generator=gen)[:tokens].to(DEVICE)
    slots[-1] = -1  # a padding token last: the redone token writes nothing either
    want = run_with_tokens_per_program(monkeypatch, 1, args, v, torch.bfloat16, slots)
    got = run_with_tokens_per_program(monkeypatch, per_program, args, v, torch.bfloat16, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[2], want[2])
    assert all(torch.equal(g, w) for g, w in zip(got[3], want[3], strict=True))
    ref_q, ref_k = qk_norm_rope_ref(*args)
    assert_matches("per program q", got[0], ref_q)


def test_tokens_per_program_by_size():
    assert qr.tokens_per_program(1) == qr.tokens_per_program(127) == 1
    assert qr.tokens_per_program(128) == qr.tokens_per_program(qr.MANY_TOKENS - 1) == 2
    assert qr.tokens_per_program(qr.MANY_TOKENS) == qr.TOKENS_PER_PROGRAM > 2


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "q_heads,k_heads,dim,rot,offset", [(32, 8, 128, 128, 0.0), (16, 2, 256, 64, 1.0)]
)
def test_gpu_many_tokens_a_program_give_the_same_bits(
    monkeypatch, q_heads, k_heads, dim, rot, offset
):
    """Compiled, at Qwen3-8B's and Qwen3-Next's head shapes: 2,053 tokens (not a multiple
    of TOKENS_PER_PROGRAM) with the prefill plan equal one token a program bit for bit."""
    tokens = 2053
    case = (tokens, q_heads, k_heads, dim, rot, offset, torch.bfloat16)
    qkv, args = make_case(*case, seed=seed_of("gpu per program", dim), max_pos=40960)
    v = split_v(qkv, q_heads, k_heads, dim)
    slots = torch.randperm(16 * BLOCK_SIZE * 40)[:tokens].to(DEVICE)
    cache_blocks = 16 * 40

    def run(per_program):
        monkeypatch.setattr(qr, "tokens_per_program", lambda num_tokens: per_program)
        cache = nan_cache(k_heads, dim, torch.bfloat16, num_blocks=cache_blocks)
        q_out, k_out = fused(args, v, cache, slots, 1.0, 1.0)
        return q_out, k_out, cache_bytes(cache)

    want = run(1)
    for per_program in (2, 4, 8, 16):
        got = run(per_program)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), per_program
