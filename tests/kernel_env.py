"""Shared set-up of the kernel test modules that run interpreted on the CPU and compiled
on a GPU: the interpreter rounds bfloat16 as the GPU does (so bitwise checks mean the same
thing in both), and the device and markers every such module uses."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpret.conftest import round_bfloat16_like_the_gpu

    round_bfloat16_like_the_gpu()

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
