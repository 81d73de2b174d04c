"""Programmatic dependent launch (PDL) for the decode path's Triton kernels, on Hopper.

A kernel launched with PDL may start before the launch it follows has finished: once every
program of that launch has signalled (`griddepcontrol.launch_dependents`) or exited, its
programs are staged on the SMs the earlier launch leaves free. It must then wait
(`griddepcontrol.wait`, which returns once the earlier launch has finished and its writes
are visible) before it reads anything an earlier launch wrote or writes anything an
earlier launch reads. What it may do before the wait is work on data no launch writes: a
GEMV prefetches its weight rows into L2, so a decode step's weight stream need not stop
between launches. CUDA graphs keep the dependency as a programmatic edge.

Opt-in (`pdl` of contracts/envs.py: KVLOOM_FUSED=pdl): an H100 measured it slower at every
release point (Qwen3-8B batch 1, 6.240 ms/token without it; with it 7.785 releasing at the
start, 6.348 after the GEMV's loop, 6.373 at exit). It changes when work starts, never
what is computed: same bits either way.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvloom.contracts import envs


@functools.lru_cache(maxsize=16)
def _supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def uses_pdl(x: torch.Tensor) -> bool:
    """Whether kernels on x's device launch with PDL: a Hopper or newer GPU, and `pdl`
    turned on."""
    if not x.is_cuda or envs.unfused("pdl"):
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return _supports_pdl(index)


# Where a program lets the next launch stage (KVLOOM_PDL_RELEASE), the value of a kernel's
# GDC constexpr (0: PDL off). "start": first thing, in every kernel. "loop": a GEMV
# program once its main loop is done, the other kernels only at exit. "exit": every
# kernel only at exit (the launch itself may still overlap the one before's drain). On
# an H100 "start" lost 25% at batch 1 and "loop" 1.7% (why even "exit" loses is not known).
RELEASE_AT = {"start": 1, "loop": 2, "exit": 3}


def pdl_launch(gdc: bool) -> dict:
    """A PDL-aware kernel's launch keywords: its GDC constexpr (RELEASE_AT's value of
    KVLOOM_PDL_RELEASE, or 0), and Triton's `launch_pdl` where it is on (never passed
    otherwise, so the CPU interpreter never sees it)."""
    if not gdc:
        return dict(GDC=0)
    return dict(GDC=RELEASE_AT[envs.pdl_release()], launch_pdl=True)


@triton.jit
def pdl_release_then_wait(GDC: tl.constexpr):
    """At a program's start: let the next launch stage (GDC 1, "start"), then wait for the
    one before (any GDC). For kernels with nothing to do before their inputs are ready."""
    if GDC == 1:
        tl.extra.cuda.gdc_launch_dependents()
    if GDC:
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_l2(ptrs):
    """Asks for the 128-byte lines at `ptrs` to be brought into L2 (a hint; no value is
    loaded). Not pure, so the compiler keeps it though nothing reads its result."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // $0",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
