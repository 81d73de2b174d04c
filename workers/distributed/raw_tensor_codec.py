"""torch side of `RawTensor`: tensors that must cross the step channel travel as dtype name,
shape and raw bytes (the control plane never imports torch, and nothing is pickled)."""

from __future__ import annotations

import torch

from kvloom.contracts.step_channel import RawTensor


def tensor_to_raw(tensor: torch.Tensor) -> RawTensor:
    """Copy a tensor (any device) into a `RawTensor`, bit for bit."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    cpu = tensor.detach().to("cpu").contiguous()
    data = cpu.reshape(-1).view(torch.uint8).numpy().tobytes() if cpu.numel() else b""
    return RawTensor(str(cpu.dtype).removeprefix("torch."), tuple(cpu.shape), data)


def raw_to_tensor(raw: RawTensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """Rebuild the tensor a `RawTensor` describes, on `device`."""
    dtype = getattr(torch, raw.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"raw.dtype {raw.dtype!r} is not a torch dtype name")
    numel = 1
    for d in raw.shape:
        numel *= d
    expected = numel * torch.empty((), dtype=dtype).element_size()
    if len(raw.data) != expected:
        raise ValueError(
            f"raw.data has {len(raw.data)} bytes but dtype {raw.dtype} and shape "
            f"{tuple(raw.shape)} need {expected}"
        )
    if numel == 0:
        return torch.empty(raw.shape, dtype=dtype, device=device)
    # bytearray: frombuffer needs a writable buffer to avoid a warning, and the copy owns it.
    flat = torch.frombuffer(bytearray(raw.data), dtype=torch.uint8)
    return flat.view(dtype).reshape(raw.shape).to(device)
