"""KDA's fused decode step (`kda_decode_triton`, kernels/gated_delta_rule_triton.py) against
the three launches it replaces: `kda_gates_triton`, then `recurrent_kda_triton` with those
g and beta, then `kda_gated_norm_triton`. Bit for bit: the output of every real row and
the whole state pool (each separate kernel is tested against its torch reference in its
own file; here the fused step is also checked close to the torch references).

Inputs are cut as the layer cuts them: q, k, v strided column views of the conv output,
beta's logits the last columns of qkv_proj's output, raw_gate (f_b's output) and the norm
gate (g_b's output) [N, H, D]. Padding rows (slot -1) carry NaN inputs and must give exact
zeros; slots no row names hold NaN and must keep their bits.

Without CUDA the kernels run in Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1) at small shapes; with CUDA the same tests run compiled, and the
`gpu`-marked ones add Kimi-Linear's shape (32 heads x 128) and a CUDA-graph replay.
A layer-level launch record shows what the decode step calls before and after.
"""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvloom.kernels import kda as kda_ref
from kvloom.kernels import ops
from kvloom.kernels.gated_delta_rule_triton import (
    fuses_norm,
    kda_decode_triton,
    recurrent_kda_triton,
    uses_norm_tail,
)
from kvloom.kernels.kda_gated_norm import kda_gated_norm_ref
from kvloom.kernels.kda_gated_norm_triton import kda_gated_norm_triton
from kvloom.kernels.kda_gates import kda_gates_ref
from kvloom.kernels.kda_gates_triton import kda_gates_triton
from kvloom.workers.layers import kda_layer as kda_module
from kvloom.workers.layers.kda_layer import KimiDeltaAttention
from tests.kernel_env import CUDA, DEVICE, gpu, needs_cuda

EPS = 1e-5


def make_step(rows, heads, dim, dtype, *, seed, num_pad=0, state_dtype=torch.float32):
    """One decode step's inputs (made on the CPU, moved to DEVICE): a dict of the fused
    call's arguments, and the slots the real rows use."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE)

    width = heads * dim
    conv_out = randn(rows, 3 * width + 5).to(dtype)[:, : 3 * width]  # rows strided
    q, k, v = (part.view(rows, heads, dim) for part in conv_out.split(width, dim=-1))
    projected = randn(rows, 3 * width + heads).to(dtype)  # qkv_proj: q | k | v | beta logits
    beta_logits = projected[:, 3 * width :]
    raw_gate = randn(rows, heads, dim, scale=2.0).to(dtype)
    gate = randn(rows, heads, dim, scale=2.0).to(dtype)
    A_log = randn(heads, scale=0.5).to(dtype)
    dt_bias = randn(width, scale=0.5).to(dtype)
    weight = (1.0 + 0.3 * randn(dim)).to(dtype)
    num_slots = rows + 3
    pool = randn(num_slots, heads, dim, dim, scale=0.3).to(state_dtype)
    slots = torch.randperm(num_slots, generator=gen)[:rows]
    used = slots[: rows - num_pad].tolist()
    unused = [s for s in range(num_slots) if s not in used]
    pool[unused] = float("nan")
    if num_pad:
        slots[rows - num_pad :] = -1
        for t in (q, k, v, beta_logits, raw_gate, gate):
            t[rows - num_pad :] = float("nan")
    args = dict(
        q=q, k=k, v=v, raw_gate=raw_gate, A_log=A_log, dt_bias=dt_bias,
        beta_logits=beta_logits, state=pool, state_indices=slots.to(DEVICE), gate=gate,
        norm_weight=weight, norm_eps=EPS,
    )  # fmt: skip
    return args, used


def separate(a, block_v=None):
    """The three launches the fused step replaces."""
    g, beta = kda_gates_triton(a["raw_gate"], a["A_log"], a["dt_bias"], a["beta_logits"])
    out = recurrent_kda_triton(
        a["q"], a["k"], a["v"], g, beta, a["state"], a["state_indices"],
        use_qk_l2norm=True, _block_v_override=block_v,
    )  # fmt: skip
    return kda_gated_norm_triton(out, a["gate"], a["norm_weight"], a["norm_eps"])


def clone_args(a):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in a.items()}


def check_fused(args, used, block_v=None):
    want_args, got_args = clone_args(args), clone_args(args)
    want = separate(want_args, block_v)
    got = kda_decode_triton(**got_args, use_qk_l2norm=True, _block_v_override=block_v)
    real = len(used)
    head_k, head_v = args["q"].shape[2], args["v"].shape[2]
    # The norm in the step's launch: one program a head, or the head's last (the norm
    # tail, on unless KVLOOM_UNFUSED names linear_norm_tail).
    whole_head = block_v >= head_v if block_v else fuses_norm(head_k, head_v)
    one_launch = whole_head or uses_norm_tail(args["q"].shape[0])
    assert got.shape == want.shape and got.dtype == args["q"].dtype
    assert torch.equal(got[:real], want[:real]), "output differs from the three launches"
    if one_launch:  # padding rows are zeros
        assert torch.equal(got[real:], torch.zeros_like(got[real:])), "padding rows not zero"
    else:  # the separate norm's of the recurrence's zeros, as bits (NaN for a NaN gate)
        as_bits = {4: torch.int32, 2: torch.int16}[got.element_size()]
        assert torch.equal(got[real:].view(as_bits), want[real:].view(as_bits))
    # The whole pool, NaN slots included, bit for bit (NaN == NaN compared as bits).
    assert torch.equal(got_args["state"].view(torch.int8), want_args["state"].view(torch.int8))
    return got, got_args["state"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,num_pad", [(1, 0), (2, 0), (3, 1)])
@pytest.mark.parametrize("dim", [16, 32])
def test_fused_equals_three_launches_bitwise(dtype, rows, num_pad, dim):
    args, used = make_step(rows, 3, dim, dtype, seed=zlib.crc32(repr((dtype, rows, dim)).encode()))
    args_pad, used_pad = make_step(rows, 3, dim, dtype, seed=rows + dim, num_pad=num_pad)
    assert fuses_norm(dim, dim)  # one launch at these head dims
    check_fused(args, used)
    check_fused(args_pad, used_pad)


def test_two_launch_plan_and_half_state_bitwise():
    """A value head wider than one program (the norm then separate: two launches) and a
    bf16 state pool give the separate launches' bits too."""
    args, used = make_step(2, 2, 32, torch.bfloat16, seed=11, state_dtype=torch.bfloat16)
    check_fused(args, used, block_v=8)
    check_fused(args, used)


def test_close_to_the_torch_references():
    """The fused step against kda_gates_ref, recurrent_kda and kda_gated_norm_ref in
    float32 (the bits above tie it to the separate kernels; this ties it to the math)."""
    args, used = make_step(3, 2, 16, torch.float32, seed=12, num_pad=1)
    ref_state = args["state"].clone()
    got = kda_decode_triton(**clone_args(args), use_qk_l2norm=True)
    g, beta = kda_gates_ref(args["raw_gate"], args["A_log"], args["dt_bias"], args["beta_logits"])
    core = kda_ref.recurrent_kda(
        args["q"], args["k"], args["v"], g, beta, ref_state, args["state_indices"],
        use_qk_l2norm=True,
    )  # fmt: skip
    want = kda_gated_norm_ref(core.to(args["q"].dtype), args["gate"], args["norm_weight"], EPS)
    torch.testing.assert_close(got[:2], want[:2], rtol=2e-5, atol=2e-5)


def test_bad_arguments_name_the_field():
    args, _ = make_step(2, 2, 16, torch.bfloat16, seed=13)
    with pytest.raises(ValueError, match="raw_gate"):
        cut = {"raw_gate": args["raw_gate"][:1], "beta_logits": args["beta_logits"][:1]}
        kda_decode_triton(**{**args, **cut})  # gates of one row for two rows
    with pytest.raises(ValueError, match="gate"):
        kda_decode_triton(**{**args, "gate": args["gate"][:, :, :8]})
    with pytest.raises(ValueError, match="beta_logits"):
        kda_decode_triton(**{**args, "beta_logits": args["beta_logits"][:1]})


@pytest.mark.parametrize(
    "rows,dtype,deterministic,unfused,fuses",
    [
        (1, torch.bfloat16, False, "", True),
        (2, torch.float16, False, "", True),
        (3, torch.bfloat16, False, "", False),  # past GEMV_DISPATCH_MAX_M rows
        (1, torch.float32, False, "", False),  # half precision only
        (1, torch.bfloat16, True, "", False),  # the deterministic mode
        (1, torch.bfloat16, False, "kda_decode", False),
        (1, torch.bfloat16, False, "kda_norm", False),
    ],
)
def test_ops_dispatch(monkeypatch, rows, dtype, deterministic, unfused, fuses):
    """ops.kda_decode_step takes the fused launch only at decode; the separate calls give
    the same bits (here the Triton ones, interpreted: use_triton forced)."""
    import kvloom.kernels.gated_delta_rule_triton as gdr
    from kvloom.kernels import dispatch

    calls = []
    kernel = gdr.kda_decode_triton
    monkeypatch.setattr(
        gdr, "kda_decode_triton", lambda *a, **k: (calls.append(1), kernel(*a, **k))[1]
    )
    monkeypatch.setattr(ops, "use_triton", lambda t: t.dtype in ops.TRITON_DTYPES)
    monkeypatch.setattr(dispatch, "_batch_invariant", deterministic)
    monkeypatch.setenv("KVLOOM_UNFUSED", unfused)
    args, used = make_step(rows, 2, 16, dtype, seed=14)
    want_args = clone_args(args)
    out = ops.kda_decode_step(*args.values())
    assert calls == ([1] if fuses else [])
    want = separate(want_args)
    # The state: the same Triton recurrence either way. The output: the separate launches'
    # bits where the Triton norm runs unfused (else torch's norm, within an ulp: its tests).
    assert torch.equal(args["state"].view(torch.int32), want_args["state"].view(torch.int32))
    if fuses or unfused == "kda_decode":
        assert torch.equal(out, want)


# ---------------------------------------------------------------- the layer's launches


KERNELS = (
    "kda_gates",
    "causal_conv1d_update",
    "recurrent_kda",
    "kda_gated_norm",
    "kda_decode_step",
)
VIEWS = {"view", "reshape", "split", "split_with_sizes", "slice", "t", "_unsafe_view"}


class LaunchRecorder(TorchDispatchMode):
    """Records the torch ops a forward dispatches, each kernel above as one entry."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.inside_kernel = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside_kernel:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def kernel(self, name, fn):
        def run(*args, **kwargs):
            self.ops.append(name)
            self.inside_kernel = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside_kernel = False

        return run


def decode_launches(monkeypatch) -> list[str]:
    """A decode-only step of a small float64 KDA layer: the ops it dispatches."""
    torch.manual_seed(0)
    layer = KimiDeltaAttention(0, 32, 2, 16, 4, EPS, dtype=torch.float64)
    for p in layer.parameters():
        p.data.normal_(0.0, 0.3)
    layer.conv_state = torch.zeros(4, *layer.conv_state_shape, dtype=torch.float64)
    layer.recurrent_state = torch.zeros(4, *layer.recurrent_state_shape, dtype=torch.float64)
    slots = torch.tensor([2, 0])
    batch = SimpleNamespace(
        decode_only=True, group_for=lambda i: SimpleNamespace(state_indices=slots)
    )
    hidden = torch.randn(2, 32, dtype=torch.float64)
    recorder = LaunchRecorder()
    with monkeypatch.context() as patch:
        for name in KERNELS:
            if hasattr(kda_module, name):
                patch.setattr(kda_module, name, recorder.kernel(name, getattr(kda_module, name)))
        with torch.inference_mode(), recorder:
            layer(hidden, batch)
    return [op for op in recorder.ops if op not in VIEWS]


def test_decode_step_launches(monkeypatch):
    """A decode-only step of a KDA layer: qkv_proj, fg_a_proj, f_b_proj, g_b_proj, the conv
    update, the fused gates + recurrence + output norm, o_proj: 7 launches. Recorded the
    same way before this change (float64, so the no-op `to`s after recurrent_kda are not
    launches; at half precision every `to` below is one):
    linear x3, kda_gates, causal_conv1d_update, recurrent_kda, to, linear (g_b_proj), the
    output norm as torch ops [to, pow, mean, add, rsqrt, mul, to, mul, to, sigmoid, mul,
    to], linear (o_proj): 20 launches. (The input norm is in qkv_proj's GEMV now, through
    the decoder layer's norm_linear: not part of this record.)"""
    launches = decode_launches(monkeypatch)
    assert launches == ["linear"] * 4 + ["causal_conv1d_update", "kda_decode_step", "linear"]
    # Kimi-Linear's 128 x 128 heads take narrow tiles, the norm a second launch inside
    # kda_decode_step (faster on an H100 than a whole head per program).
    assert not fuses_norm(128, 128)


# ---------------------------------------------------------------- the benchmark


@pytest.mark.skipif(CUDA, reason="the real run is the GPU benchmark itself")
def test_benchmark_tiny_run_writes_json(tmp_path):
    """benchmarks/kda_decode_fusion.py --tiny (CPU interpreter): every variant gives its
    three launches' bits, and the production plan is one of the timed variants at every
    shape (a tile budget that no variant matches would go untimed)."""
    from benchmarks import kda_decode_fusion as bench

    out = tmp_path / "kda.json"
    result = bench.main(["--tiny", "--out", str(out)])
    assert out.exists() and result["timing"] == "cpu_interpreter_wall"
    runs = len(bench.TINY_SHAPES) * len(bench.TINY_ROWS) * len(bench.TINY_VARIANTS)
    assert len(result["rows"]) == runs
    assert all(r["same_bits_as_three_launches"] for r in result["rows"]), result["rows"]
    plans = result["production_variant"]
    assert set(plans) == {*bench.SHAPES, *bench.TINY_SHAPES}
    assert all(plans[s] in bench.VARIANTS for s in bench.SHAPES), plans
    assert all(plans[s] in bench.TINY_VARIANTS for s in bench.TINY_SHAPES), plans


# ---------------------------------------------------------------- on the GPU


@gpu
@needs_cuda
@pytest.mark.parametrize("rows,num_pad", [(1, 0), (2, 1), (8, 2)])
def test_gpu_kimi_linear_shape_bitwise(rows, num_pad):
    """Kimi-Linear (32 KDA heads of 128 at TP = 1), compiled: the three launches' bits."""
    args, used = make_step(rows, 32, 128, torch.bfloat16, seed=rows, num_pad=num_pad)
    check_fused(args, used)


@gpu
@needs_cuda
def test_gpu_cuda_graph_replay():
    """Captured once, replayed on fresh inputs: the eager fused launch's bits."""
    args, used = make_step(1, 32, 128, torch.bfloat16, seed=21)
    graph_args = clone_args(args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = kda_decode_triton(**graph_args, use_qk_l2norm=True)
    fresh, _ = make_step(1, 32, 128, torch.bfloat16, seed=22)
    for name in ("q", "k", "v", "raw_gate", "beta_logits", "gate", "state"):
        graph_args[name].copy_(fresh[name])
    eager_args = clone_args(graph_args)
    graph.replay()
    torch.cuda.synchronize()
    want = kda_decode_triton(**eager_args, use_qk_l2norm=True)
    assert torch.equal(graph_out, want)
    # The whole pool, its NaN (unused) slots included, as bits: NaN != NaN as floats.
    assert torch.equal(graph_args["state"].view(torch.int8), eager_args["state"].view(torch.int8))
