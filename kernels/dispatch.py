"""Chooses between the Triton kernels and their pure-torch references.

Model code asks `use_triton(tensor)` once per call site: the Triton kernels run on CUDA
tensors of half or single precision when Triton imports; everything else (CPU, float64,
`KVLOOM_DISABLE_TRITON=1`) takes the reference path, which has the same semantics.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from kvloom.contracts import envs

DISABLE_ENV = "KVLOOM_DISABLE_TRITON"

# The dtypes every kvloom Triton kernel is written and tested for.
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def triton_available() -> bool:
    """True when the `triton` package is importable (checked once per process)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install counts as absent: the references still work
        return False
    return True


def triton_disabled_by_env() -> bool:
    """`KVLOOM_DISABLE_TRITON=1` (or true/yes/on) forces the reference path; read each call."""
    return envs.flag(DISABLE_ENV)


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether a kernel whose main input is `tensor` should take the Triton path."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"tensor: expected a torch.Tensor, got {type(tensor).__name__}")
    return (
        tensor.is_cuda
        and tensor.dtype in TRITON_DTYPES
        and not triton_disabled_by_env()
        and triton_available()
    )


# -- deterministic (batch-invariant) mode ---------------------------------------------------
# `deterministic=True` sets this where the model is built (workers/layers/quantization/
# build.py), in the process that runs it; kernels/ops.py and the layers then pick the
# batch-invariant plans (kernels/batch_invariant.py). Process-wide, as the kernels are: one
# process serves one model, and every build sets it to its own config's value.
_batch_invariant = False


def set_batch_invariant(enabled: bool) -> None:
    """Turns the batch-invariant kernel plans on or off for this process."""
    global _batch_invariant
    _batch_invariant = bool(enabled)


def batch_invariant() -> bool:
    """Whether the deterministic mode's batch-invariant plans are on in this process."""
    return _batch_invariant
