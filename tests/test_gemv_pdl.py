"""The GEMV launched with programmatic dependent launch (kernels/gemv_triton.py `uses_pdl`,
opt-in `pdl` of contracts/envs.py).

* When it applies: a CUDA tensor on a compute capability 9.0+ GPU, with KVLOOM_FUSED
  naming `pdl` and KVLOOM_UNFUSED not; never on the CPU.
* The launch: the GEMV kernel gets GDC and `launch_pdl`; the split-K reduce does not.
* Built for sm_90 on the CPU (tests/hopper_compile.py's compile-only driver): the GDC
  variant's PTX waits on the launch before it and releases the next one; the plain
  variant has neither instruction.
* `gpu`: a chain of GEMVs, each reading the one before's output, gives the same bits with
  and without PDL, eager and replayed from a CUDA graph.
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
from kvloom.kernels.gemv_triton import GemvPlan, gemv_triton, launch_gemv, uses_pdl
from tests.kernel_env import gpu, needs_cuda

ROOT = Path(__file__).parents[1]


def fake_cuda_tensor(index=0):
    return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", index))


def test_pdl_is_opt_in_hopper_only_and_never_on_cpu(monkeypatch):
    monkeypatch.delenv("KVLOOM_FUSED", raising=False)
    monkeypatch.delenv("KVLOOM_UNFUSED", raising=False)
    monkeypatch.setattr(gt, "_supports_pdl", lambda index: index == 0)
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
    assert kwargs["GDC"] is pdl
    assert kwargs.get("launch_pdl", False) is pdl
    assert all("launch_pdl" not in k and not k.get("GDC") for k in reduce.launches)
    assert len(reduce.launches) == (split_k > 1)


BUILD_SCRIPT = """
import torch
from triton import compiler

from kvloom.kernels.gemv_triton import GemvPlan, launch_gemv

ptx = []
real = compiler.compile


def compile(src, *args, **kwargs):
    kernel = real(src, *args, **kwargs)
    if getattr(getattr(src, "fn", None), "__name__", "") == "_gemv_kernel":
        ptx.append(kernel.asm["ptx"])
    return kernel


compiler.compile = compile
x = torch.ones(1, 512, dtype=torch.bfloat16)
w = torch.ones(256, 512, dtype=torch.bfloat16)
for pdl in (True, False):
    for split_k in (1, 2):
        out = torch.empty(1, 256, dtype=torch.bfloat16)
        launch_gemv(x, w, None, out, GemvPlan(16, 128, 4, 2, split_k), pdl=pdl)
for text in ptx:
    print("PTX", "griddepcontrol.wait" in text, "griddepcontrol.launch_dependents" in text)
"""


def test_the_gdc_variant_builds_for_sm90_with_its_wait_and_release(tmp_path):
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
    assert lines == ["PTX True True"] * 2 + ["PTX False False"] * 2, done.stdout


@gpu
@needs_cuda
@pytest.mark.parametrize("plan", [None, GemvPlan(16, 256, 4, 3, split_k=4)])
def test_gpu_chained_gemvs_give_the_same_bits_with_pdl(monkeypatch, plan):
    """Three GEMVs, each reading the output of the one before (the hazard PDL must wait
    on), with and without PDL, eager and from a CUDA graph: the same bits."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    gen = torch.Generator().manual_seed(7)
    ws = [
        (torch.randn(4096, 4096, generator=gen) / 64).to("cuda", torch.bfloat16) for _ in range(3)
    ]

    def chain(x):
        for w in ws:
            x = gemv_triton(torch.nn.functional.silu(x), w, None, plan=plan)
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
