"""The decode kernels launched with programmatic dependent launch (kernels/pdl_triton.py,
opt-in `pdl` of contracts/envs.py): the GEMV, RMSNorm, q/k norm + rotary, and the split-KV
attention with its merge.

* When it applies: a CUDA tensor on a compute capability 9.0+ GPU, with KVLOOM_FUSED
  naming `pdl` and KVLOOM_UNFUSED not; never on the CPU.
* The launch: the GEMV kernel gets GDC, `launch_pdl` and its prefetch constexprs; the
  split-K reduce gets none of them.
* Built for sm_90 on the CPU (tests/hopper_compile.py's compile-only driver): every GDC
  variant's PTX releases the next launch and waits on the one before, and the GEMV's
  prefetches its weight into L2; the plain variants have none of these instructions.
* `gpu`: norm -> GEMV -> GEMV chains, each launch reading the one before's output, give
  the same bits with and without PDL, eager and replayed from a CUDA graph.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from kvloom.kernels import gemv_triton as gt
from kvloom.kernels import pdl_triton
from kvloom.kernels.gemv_triton import GemvPlan, gemv_triton, launch_gemv
from kvloom.kernels.pdl_triton import uses_pdl
from kvloom.kernels.rms_norm_triton import rms_norm_triton
from tests.kernel_env import gpu, needs_cuda

ROOT = Path(__file__).parents[1]


def fake_cuda_tensor(index=0):
    return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", index))


def test_pdl_is_opt_in_hopper_only_and_never_on_cpu(monkeypatch):
    monkeypatch.delenv("KVLOOM_FUSED", raising=False)
    monkeypatch.delenv("KVLOOM_UNFUSED", raising=False)
    monkeypatch.setattr(pdl_triton, "_supports_pdl", lambda index: index == 0)
    assert not uses_pdl(fake_cuda_tensor())  # opt-in
    monkeypatch.setenv("KVLOOM_FUSED", "pdl")
    assert uses_pdl(fake_cuda_tensor())
    assert not uses_pdl(fake_cuda_tensor(1))  # a GPU older than Hopper
    assert not uses_pdl(torch.ones(2))
    monkeypatch.setenv("KVLOOM_UNFUSED", "pdl")  # wins over KVLOOM_FUSED
    assert not uses_pdl(fake_cuda_tensor())


class RecordingKernel:
    """Stands in for a @triton.jit kernel: records each launch's keyword arguments."""

    def __init__(self):
        self.launches: list[dict] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(kwargs)


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("pdl", [True, False])
def test_launch_passes_gdc_to_the_gemv_only(monkeypatch, pdl, split_k):
    gemv, reduce = RecordingKernel(), RecordingKernel()
    monkeypatch.setattr(gt, "_gemv_kernel", gemv)
    monkeypatch.setattr(gt, "_split_k_reduce_kernel", reduce)
    x, w = torch.ones(1, 256), torch.ones(64, 256)
    launch_gemv(x, w, None, torch.empty(1, 64), GemvPlan(16, 128, 4, 1, split_k), pdl=pdl)
    [kwargs] = gemv.launches
    assert kwargs["GDC"] == (2 if pdl else 0)  # KVLOOM_PDL_RELEASE's default, "loop"
    assert kwargs.get("launch_pdl", False) is pdl
    # 128-byte lines of fp32 weight (32 elements) over the program's K range
    span = 256 // split_k
    assert kwargs.get("PREFETCH_LINES") == (span // 32 if pdl else None)
    assert all("launch_pdl" not in k and "GDC" not in k for k in reduce.launches)
    assert len(reduce.launches) == (split_k > 1)


@pytest.mark.parametrize("setting,lines", [(None, 16), ("4", 4), ("0", 0)])
def test_prefetch_is_the_first_lines_of_each_row_only(monkeypatch, setting, lines):
    """A long bf16 row (K 8192: 128 lines) prefetches its first KVLOOM_PDL_PREFETCH_LINES
    lines (16 unless set; 0: none)."""
    if setting is None:
        monkeypatch.delenv("KVLOOM_PDL_PREFETCH_LINES", raising=False)
    else:
        monkeypatch.setenv("KVLOOM_PDL_PREFETCH_LINES", setting)
    gemv = RecordingKernel()
    monkeypatch.setattr(gt, "_gemv_kernel", gemv)
    x, w = torch.ones(1, 8192, dtype=torch.bfloat16), torch.ones(64, 8192, dtype=torch.bfloat16)
    launch_gemv(
        x, w, None, torch.empty(1, 64, dtype=torch.bfloat16), GemvPlan(16, 128, 4, 1), pdl=True
    )
    [kwargs] = gemv.launches
    assert (kwargs["PREFETCH_LINES"], kwargs["LINE"]) == (lines, 64)


@pytest.mark.parametrize("setting,gdc", [(None, 2), ("start", 1), ("loop", 2), ("EXIT", 3)])
def test_the_release_point_is_the_gdc_constexpr(monkeypatch, setting, gdc):
    if setting is None:
        monkeypatch.delenv("KVLOOM_PDL_RELEASE", raising=False)
    else:
        monkeypatch.setenv("KVLOOM_PDL_RELEASE", setting)
    gemv = RecordingKernel()
    monkeypatch.setattr(gt, "_gemv_kernel", gemv)
    x, w = torch.ones(1, 256), torch.ones(64, 256)
    launch_gemv(x, w, None, torch.empty(1, 64), GemvPlan(16, 128, 4, 1), pdl=True)
    launch_gemv(x, w, None, torch.empty(1, 64), GemvPlan(16, 128, 4, 1), pdl=False)
    assert [k["GDC"] for k in gemv.launches] == [gdc, 0]


def test_a_bad_release_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv("KVLOOM_PDL_RELEASE", "middle")
    monkeypatch.setattr(gt, "_gemv_kernel", RecordingKernel())
    x, w = torch.ones(1, 256), torch.ones(64, 256)
    with pytest.raises(ValueError, match="KVLOOM_PDL_RELEASE"):
        launch_gemv(x, w, None, torch.empty(1, 64), GemvPlan(16, 128, 4, 1), pdl=True)


@pytest.mark.parametrize("bad", ["-1", "two"])
def test_a_bad_prefetch_setting_names_the_variable(monkeypatch, bad):
    monkeypatch.setenv("KVLOOM_PDL_PREFETCH_LINES", bad)
    x, w = torch.ones(1, 256, dtype=torch.bfloat16), torch.ones(64, 256, dtype=torch.bfloat16)
    out = torch.empty(1, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(gt, "_gemv_kernel", RecordingKernel())
    with pytest.raises(ValueError, match="KVLOOM_PDL_PREFETCH_LINES"):
        launch_gemv(x, w, None, out, GemvPlan(16, 128, 4, 1), pdl=True)


BUILD_SCRIPT = """
import os

import torch
from triton import compiler

from kvloom.kernels import paged_attention_triton as pa
from kvloom.kernels import qk_norm_rope_triton as qr
from kvloom.kernels import rms_norm_triton as rt
from kvloom.kernels.gemv_triton import GemvPlan, launch_gemv

ptx = []
real = compiler.compile
KERNELS = (
    "_gemv_kernel",
    "_rms_norm_kernel",
    "_qk_norm_rope_kernel",
    "_paged_attention_kernel",
    "_merge_decode_splits_kernel",
)


def compile(src, *args, **kwargs):
    kernel = real(src, *args, **kwargs)
    name = getattr(getattr(src, "fn", None), "__name__", "")
    if name in KERNELS:
        ptx.append((name, kernel.asm["ptx"]))
    return kernel


def show():
    for name, text in ptx:
        ops = ("griddepcontrol.launch_dependents", "griddepcontrol.wait", "prefetch.global.L2")
        found = [op in text for op in ops]
        # where it releases: before the wait (at the start), or after it
        if all(found[:2]):
            found.append(text.index(ops[0]) < text.index(ops[1]))
        print("PTX", name, *found)
    ptx.clear()


compiler.compile = compile
os.environ["KVLOOM_PDL_RELEASE"] = "start"  # the variants below release first thing
x = torch.ones(1, 512, dtype=torch.bfloat16)
w = torch.ones(256, 512, dtype=torch.bfloat16)
for pdl in (True, False):
    for split_k in (1, 2):
        out = torch.empty(1, 256, dtype=torch.bfloat16)
        launch_gemv(x, w, None, out, GemvPlan(16, 128, 4, 2, split_k), pdl=pdl)
    show()
os.environ["KVLOOM_PDL_PREFETCH_LINES"] = "0"  # PDL without the prefetch
launch_gemv(x, w, None, out, GemvPlan(16, 128, 4, 2, 1), pdl=True)
del os.environ["KVLOOM_PDL_PREFETCH_LINES"]
show()
for release in ("loop", "exit"):  # after the GEMV's main loop, then at exit only
    os.environ["KVLOOM_PDL_RELEASE"] = release
    launch_gemv(x, w, None, out, GemvPlan(16, 128, 4, 2, 1), pdl=True)
    rt.uses_pdl = lambda t: True
    rt.rms_norm_triton(x, torch.ones(512, dtype=torch.bfloat16), 1e-6, residual=x.clone())
    show()
os.environ["KVLOOM_PDL_RELEASE"] = "start"
for pdl in (True, False):
    rt.uses_pdl = lambda t, pdl=pdl: pdl
    rt.rms_norm_triton(x, torch.ones(512, dtype=torch.bfloat16), 1e-6, residual=x.clone())
    show()

# One decode row of 128-dim heads (8 q, 2 kv) at 100 keys: rotary, split-KV attention.
q, k = torch.ones(1, 8, 128, dtype=torch.bfloat16), torch.ones(1, 2, 128, dtype=torch.bfloat16)
table = torch.ones(256, 64)
cache = torch.ones(2, 4, 64, 2, 128, dtype=torch.bfloat16)  # [k/v, blocks, page, heads, dim]
rows = dict(
    block_tables=torch.tensor([[1, 2]], dtype=torch.int32),
    query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
    seq_lens=torch.tensor([100], dtype=torch.int32),
)
for pdl in (True, False):
    qr.uses_pdl = pa.uses_pdl = lambda t, pdl=pdl: pdl
    qr.qk_norm_rope_triton(q, k, torch.tensor([99]), table, table, None, None, 1e-6)
    pa.paged_attention_decode_split_triton(q, cache, scale=0.1, **rows)
    show()
"""


ATTENTION = ("_qk_norm_rope_kernel", "_paged_attention_kernel", "_merge_decode_splits_kernel")


def test_the_gdc_variants_build_for_sm90_with_their_release_wait_and_prefetch(tmp_path):
    script = tmp_path / "build_gemv_pdl.py"
    script.write_text(BUILD_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-m", "tests.hopper_compile", str(script)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 failures" in done.stdout, done.stdout
    lines = [line for line in done.stdout.splitlines() if line.startswith("PTX")]
    gemv, norm = "PTX _gemv_kernel", "PTX _rms_norm_kernel"
    assert lines == [
        *[f"{gemv} True True True True"] * 2,
        *[f"{gemv} False False False"] * 2,
        f"{gemv} True True False True",  # KVLOOM_PDL_PREFETCH_LINES=0
        f"{gemv} True True True False",  # KVLOOM_PDL_RELEASE=loop: released after the wait
        f"{norm} False True False",  # ... and the norm only at exit
        f"{gemv} False True True",  # KVLOOM_PDL_RELEASE=exit
        f"{norm} False True False",
        f"{norm} True True False True",
        f"{norm} False False False",
        *[f"PTX {name} True True False True" for name in ATTENTION],
        *[f"PTX {name} False False False" for name in ATTENTION],
    ], done.stdout


@gpu
@needs_cuda
@pytest.mark.parametrize("release", ["start", "loop", "exit"])
@pytest.mark.parametrize("plan", [None, GemvPlan(16, 256, 4, 3, split_k=4)])
def test_gpu_chained_gemvs_give_the_same_bits_with_pdl(monkeypatch, plan, release):
    """An RMSNorm then three GEMVs, each reading the output of the launch before (the
    hazard PDL must wait on), with and without PDL (each KVLOOM_PDL_RELEASE point), eager
    and from a CUDA graph: the same bits."""
    monkeypatch.setenv("KVLOOM_PDL_RELEASE", release)
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    gen = torch.Generator().manual_seed(7)
    ws = [
        (torch.randn(4096, 4096, generator=gen) / 64).to("cuda", torch.bfloat16) for _ in range(3)
    ]

    norm_weight = torch.rand(4096, generator=gen).to("cuda", torch.bfloat16) + 0.5

    def chain(x):
        x, _ = rms_norm_triton(x, norm_weight, 1e-6, residual=x)
        for w in ws:
            x = gemv_triton(x, w, None, plan=plan)  # reads the launch before's output
        return x

    x = torch.randn(2, 4096, generator=gen).to("cuda", torch.bfloat16)
    monkeypatch.delenv("KVLOOM_UNFUSED", raising=False)
    monkeypatch.delenv("KVLOOM_FUSED", raising=False)
    want = chain(x)
    monkeypatch.setenv("KVLOOM_FUSED", "pdl")
    assert uses_pdl(x)
    assert torch.equal(chain(x), want)
    static_x = x.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = chain(static_x)
    for seed in (1, 2):
        fresh = torch.randn(2, 4096, generator=torch.Generator().manual_seed(seed))
        static_x.copy_(fresh.to("cuda", torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.delenv("KVLOOM_FUSED")
        assert torch.equal(static_y, chain(static_x))
        monkeypatch.setenv("KVLOOM_FUSED", "pdl")
