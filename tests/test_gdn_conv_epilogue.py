"""Gated DeltaNet's conv update in the epilogue of its decode in_proj GEMV
(`gemv_triton.rms_norm_gemv_conv_triton`, `ops.rms_norm_linear_conv`,
`GatedDeltaNet.norm_project`).

The fused launch must be BITWISE the launches it replaces: the norm + GEMV launch
(`rms_norm_gemv_triton`, itself bitwise the norm launch and the GEMV launch) followed by
the conv update launch (`causal_conv1d_update_triton`) on the first C columns of its
output: y (z, b, a and the conv input columns), the new residual, the conv output and the
whole state pool (slots no row names, and padding rows' slots, untouched). Without CUDA
the kernels run in Triton's CPU interpreter at small shapes; with CUDA the same tests run
compiled, and the `gpu`-marked ones add Qwen3-Next's shape and CUDA-graph capture.
torch.empty is NaN-filled while a test runs (test_gemv's autouse fixture), so an element
left unwritten shows.
"""

from __future__ import annotations

import pytest
import torch

from kvloom.kernels import dispatch, ops
from kvloom.kernels import gemv_triton as gt
from kvloom.kernels.causal_conv1d_triton import causal_conv1d_update_triton
from kvloom.kernels.gemv import rms_norm_gemv_conv_ref
from kvloom.kernels.gemv_triton import (
    GemvPlan,
    gemv_conv_triton,
    gemv_triton,
    rms_norm_gemv_conv_triton,
    rms_norm_gemv_triton,
)
from tests.engine_helpers import record_steps
from tests.kernel_env import DEVICE, gpu, needs_cuda
from tests.test_gemv import nan_filled_empty, randn  # noqa: F401 (autouse)

# norm_gemv is opt-in (contracts/envs.py OPT_IN_FUSIONS): these tests check it.
pytestmark = pytest.mark.usefixtures("norm_gemv_on")


EPS = 1e-6
WIDTH = 4  # Qwen3-Next's linear_conv_kernel_dim
SLOTS = 5
# Small [q | k | v] conv widths C and GEMV widths N (conv, then z, then b/a): TP-shard-like
# shapes, and C = 20 with 8-feature tiles, so the tile [16, 24) straddles the boundary.
SHAPES = ((20, 44), (64, 104), (32, 52))
# The chosen plan, a plain plan whose tiles straddle C = 20 and do not divide N, and a
# split-K plan (the conv then stays a second launch).
PLANS = (None, GemvPlan(8, 128, 2, 2), GemvPlan(4, 64, 2, 3, split_k=3))


def make_inputs(rows, channels, n, k, dtype, seed, *, state_dtype=torch.float32, slots=None):
    """x (rows strided), residual, norm weight, in_proj weight [n, k] (O(1) outputs), conv
    weight [C, K], a state pool with every slot filled, and each row's slot."""
    x = randn(rows, k + 3, seed=seed, dtype=dtype, scale=2.0)[:, :k]
    res = randn(rows, k, seed=seed + 1, dtype=dtype)
    norm_w = randn(k, seed=seed + 2, dtype=dtype, scale=0.3) + 1.0
    w = randn(n, k, seed=seed + 3, dtype=dtype, scale=k**-0.5)
    conv_w = randn(channels, WIDTH, seed=seed + 4, dtype=dtype, scale=0.5)
    pool = randn(SLOTS, channels, WIDTH - 1, seed=seed + 5, dtype=state_dtype)
    if slots is None:
        slots = [3, 1][:rows]
    indices = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    return x, res, norm_w.to(dtype), w, conv_w, pool, indices


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality that also holds for NaN (a poisoned slot left alone)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


def two_launches(x, res, norm_w, w, conv_w, pool, indices, plan):
    """What the GDN layer ran before: norm + in_proj GEMV, then the conv update launch."""
    y, new_res, _ = rms_norm_gemv_triton(x, res, norm_w, EPS, w, plan=plan)
    conv = causal_conv1d_update_triton(y[:, : conv_w.shape[0]], conv_w, None, pool, indices)
    return y, new_res, conv


def check_fused(name, x, res, norm_w, w, conv_w, pool, indices, plan=None):
    """Fused and two launches on copies of one pool: every output and the pool, bitwise."""
    want_pool, got_pool = pool.clone(), pool.clone()
    want = two_launches(x, res, norm_w, w, conv_w, want_pool, indices, plan)
    got = rms_norm_gemv_conv_triton(
        x, res, norm_w, EPS, w, None, conv_w, got_pool, indices, plan=plan
    )
    for part, a, b in zip(("y", "residual", "conv output"), got, want):
        if b is None:  # no residual in, none out
            assert a is None, f"{name}: {part}"
            continue
        assert not torch.isnan(a).any(), f"{name}: NaN in {part} (an element left unwritten)"
        assert a.shape == b.shape and torch.equal(a, b), f"{name}: {part} differs"
    assert same_bits(got_pool, want_pool), f"{name}: the state pool differs"
    return got, got_pool


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("plan", PLANS, ids=lambda p: "chosen" if p is None else p.name)
def test_fused_equals_gemv_then_conv_bitwise(dtype, rows, shape, plan):
    channels, n = shape
    case = make_inputs(rows, channels, n, 128, dtype, seed=rows + channels)
    (y, _, conv), pool = check_fused(f"{dtype} rows={rows} {shape}", *case, plan=plan)
    # The slots were read and shifted: the conv input is now their newest column.
    slots = case[-1].long()
    assert torch.equal(pool[slots, :, -1], y[:, :channels].float())
    assert torch.equal(pool[slots, :, :-1], case[-2][slots, :, 1:])


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("plan", PLANS, ids=lambda p: "chosen" if p is None else p.name)
def test_without_the_norm_equals_gemv_then_conv_bitwise(rows, plan):
    """gemv_conv_triton (the norm launched separately): bitwise gemv_triton, then the conv
    update launch, with a bias and rows strided."""
    x, _, _, w, conv_w, pool, indices = make_inputs(rows, 20, 44, 128, torch.float16, seed=31)
    bias = randn(44, seed=32, dtype=torch.float16)
    want_pool, got_pool = pool.clone(), pool.clone()
    want_y = gemv_triton(x, w, bias, plan=plan)
    want_conv = causal_conv1d_update_triton(want_y[:, :20], conv_w, None, want_pool, indices)
    y, conv = gemv_conv_triton(x, w, bias, conv_w, got_pool, indices, plan=plan)
    assert not torch.isnan(y).any() and not torch.isnan(conv).any()
    assert torch.equal(y, want_y) and torch.equal(conv, want_conv)
    assert same_bits(got_pool, want_pool)


@pytest.mark.parametrize("slots", [[-1], [-1, 2], [4, -1]])
def test_padding_row_gets_zeros_and_touches_no_slot(slots):
    """A padding row (slot -1): conv output zeros, no slot read or written (a NaN-poisoned
    pool stays NaN where no live row reads it), its y and residual as the GEMV's."""
    case = list(make_inputs(len(slots), 20, 44, 128, torch.bfloat16, seed=7, slots=slots))
    live = [s for s in slots if s >= 0]
    dead = [s for s in range(SLOTS) if s not in live]
    case[5][dead] = float("nan")
    (_, _, conv), pool = check_fused(f"padding {slots}", *case, plan=GemvPlan(8, 128, 2, 2))
    for row, slot in enumerate(slots):
        if slot < 0:
            assert torch.equal(conv[row], torch.zeros_like(conv[row]))
    assert torch.isnan(pool[dead]).all()


def test_half_precision_state_pool():
    """A pool of the activations' dtype (linear_state_dtype): the shifted window is
    rounded to it as the conv launch rounds it."""
    case = make_inputs(2, 20, 44, 128, torch.bfloat16, seed=11, state_dtype=torch.bfloat16)
    check_fused("bf16 state", *case, plan=GemvPlan(8, 128, 2, 2))
    case = make_inputs(2, 20, 44, 128, torch.bfloat16, seed=12, state_dtype=torch.float16)
    check_fused("fp16 state, bf16 input", *case, plan=GemvPlan(8, 128, 2, 2))


def test_first_layer_without_residual_and_int64_slots():
    x, _, norm_w, w, conv_w, pool, indices = make_inputs(2, 32, 52, 64, torch.bfloat16, seed=3)
    (_, res, _), _ = check_fused("no residual", x, None, norm_w, w, conv_w, pool, indices.long())
    assert res is None


def test_close_to_the_torch_reference():
    """Against the float32 torch composition (rms_norm_gemv_ref, then causal_conv1d_update):
    equal up to the GEMV's summation order, i.e. a bfloat16 ulp where a sum rounds the
    other way."""
    x, res, norm_w, w, conv_w, pool, indices = make_inputs(2, 20, 44, 128, torch.bfloat16, seed=9)
    ref_pool = pool.clone()
    y, new_res, conv = rms_norm_gemv_conv_triton(
        x, res, norm_w, EPS, w, None, conv_w, pool, indices
    )
    want_y, want_res, want_conv = rms_norm_gemv_conv_ref(
        x, res, norm_w, EPS, w, None, conv_w, ref_pool, indices
    )
    torch.testing.assert_close(y, want_y, rtol=1.6e-2, atol=1e-2)
    assert torch.equal(new_res, want_res)
    torch.testing.assert_close(conv, want_conv, rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(pool, ref_pool, rtol=1.6e-2, atol=1e-2)


def test_bad_input_names_the_field():
    x, res, norm_w, w, conv_w, pool, indices = make_inputs(1, 20, 44, 64, torch.bfloat16, seed=1)
    args = dict(conv_weight=conv_w, conv_state_pool=pool, state_indices=indices)

    def run(**over):
        a = {**args, **over}
        rms_norm_gemv_conv_triton(
            x, res, norm_w, EPS, w, None, a["conv_weight"], a["conv_state_pool"],
            a["state_indices"],
        )  # fmt: skip

    with pytest.raises(ValueError, match="conv_weight"):
        run(conv_weight=randn(45, WIDTH, seed=2, dtype=torch.bfloat16))  # more than N
    with pytest.raises(ValueError, match="conv_state_pool"):
        run(conv_state_pool=pool[:, :, :2])
    with pytest.raises(ValueError, match="state_indices"):
        run(state_indices=indices.float())
    with pytest.raises(ValueError, match="state_indices"):
        run(state_indices=torch.zeros(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="activation"):
        rms_norm_gemv_conv_triton(
            x, res, norm_w, EPS, w, None, conv_w, pool, indices, activation="gelu"
        )


# ---------------------------------------------------------------- the dispatch


class Counter:
    """Wraps a module function and counts its calls."""

    def __init__(self, monkeypatch, module, name):
        self.calls = 0
        real = getattr(module, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


MODES = ("default", "unfused=norm_gemv", "unfused=gdn_conv", "KVLOOM_NO_GEMV", "deterministic")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_ops_fuse_exactly_where_the_gemv_runs(monkeypatch, mode, dtype, rows):
    """ops.rms_norm_linear_conv puts the conv in the GEMV's epilogue exactly where the
    projection takes the GEMV (CUDA, half precision, 1-2 rows, not deterministic), unless
    KVLOOM_UNFUSED names gdn_conv: with the norm in the same launch where rms_norm_linear
    fuses it, else after the norm launch (KVLOOM_UNFUSED=norm_gemv). Whatever the path, it
    returns bitwise the old composition (rms_norm_linear, then causal_conv1d_update on its
    first C columns), pool included."""
    monkeypatch.setattr(ops, "use_triton", lambda t: True)  # the Triton paths, interpreted
    if mode == "KVLOOM_NO_GEMV":
        monkeypatch.setenv("KVLOOM_NO_GEMV", "1")
    if mode == "deterministic":
        monkeypatch.setattr(dispatch, "_batch_invariant", True)
    if mode.startswith("unfused="):
        monkeypatch.setenv("KVLOOM_UNFUSED", mode.split("=")[1])
    norm_gemv = Counter(monkeypatch, gt, "rms_norm_gemv_triton")
    fused = Counter(monkeypatch, gt, "rms_norm_gemv_conv_triton")
    gemv_conv = Counter(monkeypatch, gt, "gemv_conv_triton")
    slots = [3, -1, 0][:rows]
    x, res, norm_w, w, conv_w, pool, indices = make_inputs(
        rows, 20, 44, 64, dtype, seed=rows, slots=slots
    )
    x = x.contiguous()
    want_pool, got_pool = pool.clone(), pool.clone()
    y, new_res, _ = ops.rms_norm_linear(x, res, norm_w, EPS, w)
    want_conv = ops.causal_conv1d_update(y[:, :20], conv_w, None, want_pool, indices)
    gemv = mode not in ("KVLOOM_NO_GEMV", "deterministic") and dtype == torch.bfloat16
    gemv = gemv and rows <= 2
    assert norm_gemv.calls == (gemv and mode != "unfused=norm_gemv")

    norm_gemv.calls = 0
    got = ops.rms_norm_linear_conv(x, res, norm_w, EPS, w, None, conv_w, got_pool, indices)
    epilogue = gemv and mode != "unfused=gdn_conv"
    assert fused.calls == (epilogue and mode == "default")
    assert gemv_conv.calls == (epilogue and mode == "unfused=norm_gemv")
    assert norm_gemv.calls == (gemv and mode == "unfused=gdn_conv")  # then the conv launch
    for a, b in zip(got, (y, new_res, want_conv)):
        assert a.shape == b.shape and torch.equal(a, b)
    assert torch.equal(got_pool, want_pool)


# ---------------------------------------------------------------- the GPU


QWEN3_NEXT = dict(k=2048, n=12352, channels=8192)  # TP1: C = 2*16*128 + 32*128
QWEN3_NEXT_TP2 = dict(k=2048, n=6176, channels=4096)


@gpu
@needs_cuda
@pytest.mark.parametrize("shape", [QWEN3_NEXT, QWEN3_NEXT_TP2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("slots", [[4], [4, 2], [-1, 1], [3, -1]])
def test_gpu_qwen3_next_shape_bitwise(shape, slots):
    case = make_inputs(
        len(slots), shape["channels"], shape["n"], shape["k"], torch.bfloat16, seed=len(slots),
        slots=slots,
    )  # fmt: skip
    check_fused(f"gpu {shape} slots={slots}", *case)
    split = GemvPlan(16, 128, 4, 4, split_k=2)
    check_fused(f"gpu {shape} split", *case, plan=split)


@gpu
@needs_cuda
def test_gpu_cuda_graph_capture_and_replay():
    """Captured once, replayed over new inputs: each replay is bitwise the two launches
    run eagerly on the same inputs (the pool advancing one step per replay)."""
    s = QWEN3_NEXT
    x, res, norm_w, w, conv_w, pool, indices = make_inputs(
        2, s["channels"], s["n"], s["k"], torch.bfloat16, seed=21
    )
    want_pool = pool.clone()
    args = (x, res, norm_w, EPS, w, None, conv_w, pool, indices)
    rms_norm_gemv_conv_triton(*args)  # compile outside the capture
    want_pool.copy_(pool)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rms_norm_gemv_conv_triton(*args)
    for step in range(3):
        x.copy_(randn(*x.shape, seed=100 + step, dtype=x.dtype, scale=2.0))
        want = two_launches(x, res, norm_w, w, conv_w, want_pool, indices, None)
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(out, want):
            assert torch.equal(a, b), f"replay {step}"
        assert torch.equal(pool, want_pool), f"replay {step}: pool"


# ---------------------------------------------------------------- a model's decode


def test_qwen3_next_decode_is_bitwise_the_same_fused(monkeypatch, hybrid_model):
    """A tiny bf16 Qwen3-Next's greedy decode with the conv in the in_proj launch equals
    KVLOOM_UNFUSED=gdn_conv (the norm + in_proj launch, then the conv launch) bit for bit:
    tokens, logprobs, and the last layer's hidden state and residual at every step. On
    the CPU the linears take the GEMV at decode sizes, the norms and the conv update
    their Triton kernels, interpreted (test_rms_norm_gemv._force_decode_kernels). The
    fused launch runs once per GDN layer and decode step and removes one conv launch
    each; prefill keeps its varlen conv."""
    from kvloom import LLM
    from kvloom.contracts.sampling_params import SamplingParams
    from kvloom.kernels import causal_conv1d_triton as ct
    from tests.test_rms_norm_gemv import _force_decode_kernels

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5)
    results = {}
    for fuse in (False, True):
        with monkeypatch.context() as patch:
            patch.setenv("KVLOOM_UNFUSED", "" if fuse else "gdn_conv")
            _force_decode_kernels(patch, fuse=True)
            conv_update = Counter(patch, ct, "causal_conv1d_update_triton")
            patch.setattr(ops, "causal_conv1d_update", ct.causal_conv1d_update_triton)
            fused = Counter(patch, gt, "rms_norm_gemv_conv_triton")
            llm = LLM(
                str(hybrid_model("qwen3_next")), dtype="bfloat16", progress=False,
                block_size=16, enforce_eager=True,
            )  # fmt: skip
            model = llm.engine.executor.worker.runner.model
            states, rows = record_steps(model)
            out = llm.generate([5, 17, 33, 9, 61, 7], params, use_tqdm=False)[0].outputs[0]
            gdn = sum(1 for layer in model.model.layers if layer.kind == "linear_attention")
            results[fuse] = (out, states, fused.calls, conv_update.calls, gdn, rows)
    plain, plain_states, plain_fused, plain_convs, _, _ = results[False]
    got, got_states, fused_calls, convs, gdn, rows = results[True]
    # Steps of one row are decode-only steps here (the prompt's last token may come as a
    # one-token chunk that resumes the prefill: a decode too, by invariant 1).
    decodes = sum(1 for n in rows if n == 1)
    assert gdn >= 1 and decodes >= params.max_tokens - 1 and rows[0] > 1
    assert plain_fused == 0 and fused_calls == gdn * decodes
    assert plain_convs - convs == gdn * decodes and convs == 0
    assert len(plain_states) == len(got_states) == len(rows)
    for step, (want, have) in enumerate(zip(plain_states, got_states)):
        assert all(torch.equal(a, b) for a, b in zip(want, have, strict=True)), step
    assert got.token_ids == plain.token_ids and got.logprobs == plain.logprobs
