"""Depthwise causal conv1d decode step with a pooled conv state: the Triton kernel.

Same semantics as `causal_conv1d.causal_conv1d_update` (read its docstring for the layouts):
one new input per row, the row's last K-1 inputs read from and written back to its slot of
the pool [num_slots, C, K-1], optional bias, silu (or no) activation fused.

Work split. A program owns one (row, block of BLOCK_C channels). It loads the window
[BLOCK_C, K] as one tile: columns 0..K-2 from the slot, column K-1 the new input. Then
y = act(bias + sum_j window[:, j] * weight[:, j]) in float32, and the shifted state is
the same tile stored one column to the left (column j to state column j-1, column 0
dropped), so no register shuffle is needed. Loads precede stores within the program and
programs own disjoint channels, so updating the slot in place is safe.

Padding rows. A row whose slot index is negative writes zeros to its output and touches
nothing else: neither its slot nor its input is read (NaN there cannot leak). Slots that
no row names are never read.

CUDA graphs. The entry point never synchronises with the device: it checks shapes,
dtypes and devices only, and the grid depends on shapes only. Slot indices must be
< num_slots and distinct among non-padding rows; the reference checks both, this kernel
cannot without a sync, so callers guarantee them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.kernels.arg_checks_triton import (
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
    check_shape,
    next_power_of_2,
)

_ACTIVATIONS = {None: False, "silu": True, "swish": True}  # name -> apply silu
_INDEX_DTYPES = (torch.int32, torch.int64)
_TILE_ELEMENTS = 1024  # window values per program


@triton.jit
def _conv1d_update_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    state_ptr,
    slot_ptr,
    out_ptr,
    stride_xn,
    stride_wc,
    stride_ss,
    stride_sc,
    stride_on,
    CHANNELS: tl.constexpr,
    WIDTH: tl.constexpr,
    WIDTH_PAD: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    chan_ok = chans < CHANNELS
    out_ptrs = out_ptr + row * stride_on + chans
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot < 0:
        tl.store(out_ptrs, tl.zeros([BLOCK_C], dtype=out_ptr.dtype.element_ty), mask=chan_ok)
    else:
        taps = tl.arange(0, WIDTH_PAD)
        is_history = taps < WIDTH - 1
        state_ptrs = state_ptr + slot * stride_ss + chans[:, None] * stride_sc
        history = tl.load(
            state_ptrs + taps[None, :],
            mask=chan_ok[:, None] & is_history[None, :],
            other=0.0,
        ).to(tl.float32)
        x = tl.load(x_ptr + row * stride_xn + chans, mask=chan_ok, other=0.0).to(tl.float32)
        window = tl.where((taps == WIDTH - 1)[None, :], x[:, None], history)
        weight = tl.load(
            weight_ptr + chans[:, None] * stride_wc + taps[None, :],
            mask=chan_ok[:, None] & (taps < WIDTH)[None, :],
            other=0.0,
        ).to(tl.float32)
        y = tl.sum(window * weight, axis=1)
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + chans, mask=chan_ok, other=0.0).to(tl.float32)
        if SILU:
            y = y * tl.sigmoid(y)
        # Shift: window column j becomes state column j - 1 (column 0 falls off).
        shifted = (taps >= 1) & (taps < WIDTH)
        tl.store(
            state_ptrs + (taps - 1)[None, :],
            window.to(state_ptr.dtype.element_ty),
            mask=chan_ok[:, None] & shifted[None, :],
        )
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=chan_ok)


def _check_args(x, weight, bias, conv_state_pool, state_indices, activation):
    named = (("x", x), ("weight", weight), ("conv_state_pool", conv_state_pool))
    for name, t in named + (("bias", bias),):
        if t is None and name == "bias":
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        check_dtype(name, t)
    if not isinstance(state_indices, torch.Tensor):
        raise ValueError(
            f"state_indices: expected a torch.Tensor, got {type(state_indices).__name__}"
        )
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation: expected one of {list(_ACTIVATIONS)}, got {activation!r}")
    if x.dim() != 2:
        raise ValueError(f"x: expected [N, C], got shape {tuple(x.shape)}")
    num_rows, channels = x.shape
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise ValueError(f"weight: expected [{channels}, K >= 1], got shape {tuple(weight.shape)}")
    width = weight.shape[1]
    if bias is not None:
        check_shape("bias", bias, (channels,))
        if channels > 1 and bias.stride(0) != 1:
            raise ValueError("bias: must be contiguous")
    if conv_state_pool.dim() != 3 or tuple(conv_state_pool.shape[1:]) != (channels, width - 1):
        raise ValueError(
            f"conv_state_pool: expected [num_slots, {channels}, {width - 1}], "
            f"got shape {tuple(conv_state_pool.shape)}"
        )
    check_shape("state_indices", state_indices, (num_rows,))
    if state_indices.dtype not in _INDEX_DTYPES:
        raise ValueError(f"state_indices: expected int32 or int64, got {state_indices.dtype}")
    if num_rows > 1 and state_indices.stride(0) != 1:
        raise ValueError("state_indices: must be contiguous")
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    check_last_dim_contiguous("conv_state_pool", conv_state_pool)
    check_same_device(
        x=x,
        weight=weight,
        bias=bias,
        conv_state_pool=conv_state_pool,
        state_indices=state_indices,
    )


def causal_conv1d_update_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
    *,
    _block_channels: int | None = None,
) -> torch.Tensor:
    """One new input per row (decode), as `causal_conv1d_update`.

    x [N, C] (rows may be strided, channels contiguous); weight [C, K]; bias [C] or None;
    conv_state_pool [num_slots, C, K-1] updated in place at state_indices [N] (int32/int64;
    negative = padding row: output zeros, nothing read or written). Returns y [N, C] in x's
    dtype. No host sync; the caller guarantees indices in range and distinct.
    `_block_channels` (a power of two) overrides the channel tile, for tests.
    """
    _check_args(x, weight, bias, conv_state_pool, state_indices, activation)
    num_rows, channels = x.shape
    width = weight.shape[1]
    out = torch.empty((num_rows, channels), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    width_pad = next_power_of_2(width)
    block_c = _block_channels or min(next_power_of_2(channels), max(1, _TILE_ELEMENTS // width_pad))
    grid = (num_rows, triton.cdiv(channels, block_c))
    _conv1d_update_kernel[grid](
        x,
        weight,
        bias if bias is not None else x,  # never read without HAS_BIAS
        conv_state_pool,
        state_indices,
        out,
        x.stride(0),
        weight.stride(0),
        conv_state_pool.stride(0),
        conv_state_pool.stride(1),
        out.stride(0),
        CHANNELS=channels,
        WIDTH=width,
        WIDTH_PAD=width_pad,
        BLOCK_C=block_c,
        HAS_BIAS=bias is not None,
        SILU=_ACTIVATIONS[activation],
        num_warps=4,
    )
    return out
