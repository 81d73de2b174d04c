"""Triton kernel tests: interpreted on the CPU, compiled on a CUDA GPU.

Triton picks interpreter or compiler from TRITON_INTERPRET when `triton` is first imported
(its own library functions are decorated then) and when each kernel is decorated. Without
CUDA this conftest sets TRITON_INTERPRET=1, which works when nothing in this process has
imported triton yet. If something has (a test module collected earlier), the kernel
checks cannot run here: they are skipped in this process and `test_kernels_triton_fresh_
process.py` runs them in a fresh one instead, reporting any failure. (Setting
TRITON_INTERPRET in the suite's root conftest avoids the detour.) With CUDA nothing is set
and the same tests run compiled, plus the `gpu`-marked ones at real shapes.

The interpreter also narrows float32 to bfloat16 by truncation, where the GPU (and torch)
round to nearest even; `round_bfloat16_like_the_gpu` makes it round, so the bitwise checks
mean the same thing interpreted and compiled.
"""

from __future__ import annotations

import os
import sys

import torch

# Set when this process cannot interpret kernels; read by the test modules beside this.
CHECKS_IN_SUBPROCESS_ENV = "KVLOOM_TRITON_CHECKS_IN_SUBPROCESS"


def interpreter_usable() -> bool:
    """True unless triton was already imported for the compiler."""
    if "triton" not in sys.modules:
        return True
    import triton.language.standard as standard

    return type(standard.sum).__name__ == "InterpretedFunction"


def round_bfloat16_like_the_gpu() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_kvloom_bf16_rne", False):
        return
    truncating_cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = np.asarray(src.data, dtype=np.float32)
            bits = np.ascontiguousarray(data).view(np.uint32)
            nearest_even = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
            out = np.where(np.isnan(data), np.uint32(0x7FC0), nearest_even).astype(np.uint16)
            return interpreter.TensorHandle(out, dst_type.scalar)
        return truncating_cast(self, src, dst_type)

    builder.cast_impl = cast_impl
    builder._kvloom_bf16_rne = True


def round_fp8_like_the_gpu() -> None:
    """Makes the interpreter convert float32 <-> fp8e4nv as the GPU (and torch) do: to
    e4m3 rounding to nearest even with the exponent carry; from e4m3 with 0x7F / 0xFF
    read as NaN (the interpreter reads them as +-480, so a stale read of a page the
    sanitizer filled would go unseen)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_kvloom_fp8_rne", False):
        return
    convert = builder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar == tl.float8e4nv and src.dtype.scalar == tl.float32:
            data = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            out = data.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return interpreter.TensorHandle(out, dst_type.scalar)
        if src.dtype.scalar == tl.float8e4nv and dst_type.scalar == tl.float32:
            data = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.uint8))
            out = data.view(torch.float8_e4m3fn).float().numpy()
            return interpreter.TensorHandle(out, dst_type.scalar)
        if src.dtype.scalar == tl.float8e4nv:  # other widenings go through float32
            return convert(
                self, create_fp_to_fp(self, src, tl.float32, None), dst_type, rounding_mode
            )
        return convert(self, src, dst_type, rounding_mode)

    builder.create_fp_to_fp = create_fp_to_fp
    builder._kvloom_fp8_rne = True


if not torch.cuda.is_available():
    if interpreter_usable():
        os.environ["TRITON_INTERPRET"] = "1"
        round_bfloat16_like_the_gpu()
        round_fp8_like_the_gpu()
    elif os.environ.get("KVLOOM_HOPPER_COMPILE") != "1":  # tests/hopper_compile.py: here
        os.environ[CHECKS_IN_SUBPROCESS_ENV] = "1"
