"""Argument checks shared by the Triton kernel wrappers (no Triton import here)."""

from __future__ import annotations

import torch

from kvloom.kernels.dispatch import TRITON_DTYPES


def check_dtype(name: str, tensor: torch.Tensor) -> None:
    """Triton kernels take float16, bfloat16 and float32; the references cover the rest."""
    if tensor.dtype not in TRITON_DTYPES:
        raise ValueError(
            f"{name}: dtype {tensor.dtype} is not supported by the Triton kernel "
            "(float16, bfloat16, float32); use the reference"
        )


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """All given tensors live on one device."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
        raise ValueError(f"tensors must share one device: {listed}")


def check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(tensor.shape)}")


def check_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    """The kernels vectorise along the last dim; other dims may have any stride."""
    if tensor.dim() and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim must be contiguous (stride 1)")


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def is_interpreted(kernel) -> bool:
    """Whether Triton built this kernel for its CPU interpreter (TRITON_INTERPRET=1)."""
    return type(kernel).__name__ == "InterpretedFunction"
