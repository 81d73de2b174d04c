"""Depthwise causal conv1d decode step with a pooled conv state: the Triton kernel.

Same semantics as `causal_conv1d.causal_conv1d_update` (read its docstring for the layouts):
one new input per row, the row's last K-1 inputs read from and written back to its slot of
the pool [num_slots, C, K-1], optional bias, silu (or no) activation fused.

Work split. A program owns one (row, block of BLOCK_C channels). It loads the window
[BLOCK_C, K] as one tile: columns 0..K-2 from the slot, column K-1 the new input. Then
y = act(bias + sum_j window[:, j] * weight[:, j]) in float32, taps added in order with
explicit FMAs, and the shifted state is the same tile stored one column to the left
(column j to state column j-1, column 0 dropped), so no register shuffle is needed. A
barrier puts every load of the program before its stores, and programs own disjoint
channels, so updating the slot in place is safe. That arithmetic is one @triton.jit
helper, `conv1d_update_channels`, which Gated DeltaNet's in_proj GEMV also runs in its
epilogue (gemv_triton.gemv_conv_triton): both launches compile without mul-add
contraction and give the same bits.

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
from kvloom.kernels.batch_invariant_triton import row_of
from kvloom.kernels.device_copy import to_device

ACTIVATIONS = {None: False, "silu": True, "swish": True}  # name -> apply silu
_INDEX_DTYPES = (torch.int32, torch.int64)
_TILE_ELEMENTS = 1024  # window values per program


@triton.jit
def _column(tile, taps, j):
    """Column j of a [BLOCK, WIDTH_PAD] tile, exactly (the other columns add zeros)."""
    return tl.sum(tl.where((taps == j)[None, :], tile, 0.0), axis=1)


@triton.jit
def conv1d_update_channels(
    x,
    chans,
    ok,
    state_row,
    stride_sc,
    weight_ptr,
    stride_wc,
    bias_ptr,
    WIDTH: tl.constexpr,
    WIDTH_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    """One decode step of channels `chans` of one row: returns act(bias + sum_j window[:, j]
    * weight[:, j]) in float32 and shifts the row's state. x: the new inputs (float32);
    state_row: the row's slot (K-1 columns per channel, oldest first); ok: the channels to
    compute, nothing is read or written for the others. Shared by the conv update kernel
    and the GEMV's conv epilogue (gemv_triton), so both give the same bits: the taps are
    added in order 0..K-1 with explicit FMAs (no contraction choice left to the compiler),
    the bias and silu after, as causal_conv1d.causal_conv1d_update does."""
    taps = tl.arange(0, WIDTH_PAD)
    state_ptrs = state_row + chans[:, None] * stride_sc
    history = tl.load(
        state_ptrs + taps[None, :],
        mask=ok[:, None] & (taps < WIDTH - 1)[None, :],
        other=0.0,
    ).to(tl.float32)
    window = tl.where((taps == WIDTH - 1)[None, :], x[:, None], history)
    y = tl.zeros_like(x)
    for j in tl.static_range(WIDTH):
        w = tl.load(weight_ptr + chans * stride_wc + j, mask=ok, other=0.0).to(tl.float32)
        y = tl.fma(_column(window, taps, j), w, y)
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + chans, mask=ok, other=0.0).to(tl.float32)
    if SILU:
        y = y * tl.sigmoid(y)
    # A caller's channels may be replicated over threads (the GEMV's are): every thread
    # reads its window before any thread shifts the state.
    tl.debug_barrier()
    # Shift: window column j becomes state column j - 1 (column 0 falls off).
    shifted = (taps >= 1) & (taps < WIDTH)
    tl.store(
        state_ptrs + (taps - 1)[None, :],
        window.to(state_row.dtype.element_ty),
        mask=ok[:, None] & shifted[None, :],
    )
    return y


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
        x = tl.load(x_ptr + row * stride_xn + chans, mask=chan_ok, other=0.0).to(tl.float32)
        y = conv1d_update_channels(
            x, chans, chan_ok, state_ptr + slot * stride_ss, stride_sc, weight_ptr, stride_wc,
            bias_ptr, WIDTH, WIDTH_PAD, HAS_BIAS, SILU,
        )  # fmt: skip
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=chan_ok)


def _check_args(x, weight, bias, conv_state_pool, state_indices, activation):
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    check_dtype("x", x)
    if x.dim() != 2:
        raise ValueError(f"x: expected [N, C], got shape {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    check_conv_update_args(x, *x.shape, weight, bias, conv_state_pool, state_indices, activation)


def check_conv_update_args(
    x, num_rows, channels, weight, bias, conv_state_pool, state_indices, activation
):
    """The update's arguments besides x (checked by the caller): x's rows and channels,
    and x itself only for its device. Also the GEMV's conv epilogue's check."""
    named = (("weight", weight), ("conv_state_pool", conv_state_pool))
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
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {list(ACTIVATIONS)}, got {activation!r}")
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
        SILU=ACTIVATIONS[activation],
        num_warps=4,
        enable_fp_fusion=False,  # as the GEMV's conv epilogue compiles (gemv_triton)
    )
    return out


# -- prefill: packed sequences ---------------------------------------------------------------

_VARLEN_BLOCK_T = 16  # tokens per program
_VARLEN_BLOCK_C = 128  # channels per program


# The step's token and row counts change every step: no recompiles for their values (1,
# multiples of 16).
@triton.jit(do_not_specialize=["num_tokens", "num_seqs", "search_steps"])
def _conv1d_varlen_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    state_ptr,
    has_state_ptr,
    cu_ptr,
    out_ptr,
    new_state_ptr,
    num_tokens,
    num_seqs,
    search_steps,
    token_blocks,
    stride_xt,
    stride_wc,
    stride_sn,
    stride_sc,
    stride_ot,
    CHANNELS: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_STATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    """Programs [0, token_blocks) convolve BLOCK_T packed tokens each; the num_seqs after
    them store one sequence's new state each (its last K-1 inputs), so one launch does
    both and the host computes nothing per token."""
    block = tl.program_id(0)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    chan_ok = chans < CHANNELS
    if block < token_blocks:
        tokens = block * BLOCK_T + tl.arange(0, BLOCK_T)
        # Each token's sequence: the last n with cu[n] <= token (empty rows passed over);
        # tokens past cu[num_seqs] (padding) land on the last row and are masked below.
        seq = row_of(cu_ptr, tokens, num_seqs, search_steps)
        start = tl.load(cu_ptr + seq).to(tl.int64)
        end = tl.load(cu_ptr + seq + 1).to(tl.int64)
        token_ok = (tokens < num_tokens) & (tokens < end)
        if HAS_STATE:
            has_state = tl.load(has_state_ptr + seq, mask=token_ok, other=0) != 0
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(WIDTH):
            # Tap j reads input t - (K-1) + j: the sequence's own token, or before its
            # start the carried state, whose column K-1-d holds the input d steps before it.
            src = tokens - (WIDTH - 1) + j
            own = token_ok & (src >= start)
            x = tl.load(
                x_ptr + src[:, None] * stride_xt + chans[None, :],
                mask=own[:, None] & chan_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            if HAS_STATE:
                carried = token_ok & (src < start) & has_state
                column = (WIDTH - 1) - (start - src)
                x += tl.load(
                    state_ptr
                    + seq[:, None] * stride_sn
                    + chans[None, :] * stride_sc
                    + column[:, None],
                    mask=carried[:, None] & chan_ok[None, :],
                    other=0.0,
                ).to(tl.float32)
            w = tl.load(weight_ptr + chans * stride_wc + j, mask=chan_ok, other=0.0).to(tl.float32)
            acc += x * w[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + chans, mask=chan_ok, other=0.0).to(tl.float32)[None, :]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(
            out_ptr + tokens[:, None] * stride_ot + chans[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=(tokens < num_tokens)[:, None] & chan_ok[None, :],
        )
    else:
        _store_new_state(
            x_ptr, state_ptr, has_state_ptr, cu_ptr, new_state_ptr, block - token_blocks,
            chans, chan_ok, stride_xt, stride_sn, stride_sc, CHANNELS, WIDTH, BLOCK_C, HAS_STATE,
        )  # fmt: skip


@triton.jit
def _store_new_state(x_ptr, state_ptr, has_state_ptr, cu_ptr, new_state_ptr, seq, chans,
                     chan_ok, stride_xt, stride_sn, stride_sc, CHANNELS: tl.constexpr,
                     WIDTH: tl.constexpr, BLOCK_C: tl.constexpr,
                     HAS_STATE: tl.constexpr):  # fmt: skip
    """Sequence `seq`'s new state [C, K-1] (contiguous), oldest first: its own last inputs,
    and where it is shorter than K-1 the carried state shifted in (zeros for a fresh row):
    `_final_conv_state`'s values, each cast once from its source's dtype."""
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    out_type = new_state_ptr.dtype.element_ty
    for j in tl.static_range(WIDTH - 1):
        pos = end - (WIDTH - 1) + j
        dest = new_state_ptr + (seq * CHANNELS + chans) * (WIDTH - 1) + j
        if pos >= start:
            value = tl.load(x_ptr + pos * stride_xt + chans, mask=chan_ok, other=0.0)
            tl.store(dest, value.to(out_type), mask=chan_ok)
        elif HAS_STATE:
            # Position p before the start sits in state column K-1 - (start - p); a fresh
            # row's state is never read (zeros).
            flag = tl.load(has_state_ptr + seq).to(tl.int32)
            column = (WIDTH - 1) - (start - pos)
            carried = tl.load(
                state_ptr + seq * stride_sn + chans * stride_sc + column,
                mask=chan_ok & ((chans * 0 + flag) != 0),  # a vector mask (the interpreter's)
                other=0.0,
            )
            tl.store(dest, carried.to(out_type), mask=chan_ok)
        else:
            tl.store(dest, tl.zeros([BLOCK_C], dtype=out_type), mask=chan_ok)


def causal_conv1d_varlen_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences (prefill chunks), as `causal_conv1d.causal_conv1d_varlen`: x [T, C]
    (channels contiguous), cu_seqlens [N+1] on the host or x's device, conv_state [N, C, K-1] (gathered
    by the caller) read where has_initial_state [N]. Returns (y [T, C], the new state
    [N, C, K-1]). Every token's program reads only its own window, so the work is parallel
    over tokens and channels, and nothing is read back to the host: lengths stay on the
    device, where the kernel finds each token's sequence and stores the new states in the
    same launch (a few host ops a call: every linear-attention layer of a mixed step
    calls this). Tokens past cu_seqlens[-1] get zeros."""
    _check_varlen_args(x, weight, bias, cu_seqlens, conv_state, has_initial_state, activation)
    num_tokens, channels = x.shape
    width = weight.shape[1]
    num_seqs = cu_seqlens.shape[0] - 1
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((num_tokens, channels), dtype=x.dtype, device=x.device)
    state_dtype = x.dtype if conv_state is None else conv_state.dtype
    if num_seqs == 0 or channels == 0:
        return out.zero_(), torch.zeros(
            (num_seqs, channels, width - 1), dtype=state_dtype, device=x.device
        )
    cu = cu_seqlens.to(torch.int64)
    if cu.device != x.device:  # the layers keep chunk bounds on the host: copy, no sync
        cu = to_device(cu, torch.int64, x.device)
    history = width - 1
    if num_tokens == 0:  # every sequence empty: each keeps its carried state (or zeros)
        return out, _final_conv_state(x, cu, conv_state, has_initial_state, width, state_dtype)
    if history == 0:  # width 1: no state to keep
        _launch_varlen(x, weight, bias, cu, None, None, out, None, activation)
        return out, torch.zeros((num_seqs, channels, 0), dtype=state_dtype, device=x.device)
    new_state = torch.empty((num_seqs, channels, history), dtype=state_dtype, device=x.device)
    _launch_varlen(x, weight, bias, cu, conv_state, has_initial_state, out, new_state, activation)
    return out, new_state


def _launch_varlen(x, weight, bias, cu, conv_state, has_initial_state, out, new_state,
                   activation) -> None:  # fmt: skip
    """One launch: the packed tokens' outputs and, with `new_state`, every sequence's new
    state (`_conv1d_varlen_kernel`)."""
    num_tokens, channels = x.shape
    width = weight.shape[1]
    num_seqs = cu.shape[0] - 1
    has_state = conv_state is not None and width > 1
    if has_state:
        conv_state = conv_state if conv_state.stride(2) == 1 else conv_state.contiguous()
    token_blocks = triton.cdiv(num_tokens, _VARLEN_BLOCK_T)
    state_programs = num_seqs if new_state is not None else 0
    grid = (token_blocks + state_programs, triton.cdiv(channels, _VARLEN_BLOCK_C))
    _conv1d_varlen_kernel[grid](
        x,
        weight,
        bias if bias is not None else x,  # never read without HAS_BIAS
        conv_state if has_state else x,  # never read without HAS_STATE
        has_initial_state.to(torch.int8) if has_state else x,
        cu,
        out,
        new_state if new_state is not None else out,  # never written without state programs
        num_tokens,
        num_seqs,
        num_seqs.bit_length() + 1,
        token_blocks,
        x.stride(0),
        weight.stride(0),
        conv_state.stride(0) if has_state else 0,
        conv_state.stride(1) if has_state else 0,
        out.stride(0),
        CHANNELS=channels,
        WIDTH=width,
        BLOCK_T=_VARLEN_BLOCK_T,
        BLOCK_C=_VARLEN_BLOCK_C,
        HAS_STATE=has_state,
        HAS_BIAS=bias is not None,
        SILU=ACTIVATIONS[activation],
        num_warps=4,
    )


def _check_varlen_args(x, weight, bias, cu_seqlens, conv_state, has_initial_state, activation):
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("conv_state", conv_state)):
        if t is not None:
            check_dtype(name, t)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {list(ACTIVATIONS)}, got {activation!r}")
    if x.dim() != 2:
        raise ValueError(f"x: expected [T, C], got shape {tuple(x.shape)}")
    channels = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise ValueError(f"weight: expected [{channels}, K >= 1], got shape {tuple(weight.shape)}")
    if weight.stride(1) != 1 or (bias is not None and channels > 1 and bias.stride(0) != 1):
        raise ValueError("weight and bias: each row must be contiguous")
    if bias is not None:
        check_shape("bias", bias, (channels,))
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1 or cu_seqlens.dtype not in _INDEX_DTYPES:
        raise ValueError(f"cu_seqlens: expected an int32/int64 [N+1] tensor, got {cu_seqlens}")
    num_seqs = cu_seqlens.shape[0] - 1
    if (conv_state is None) != (has_initial_state is None):
        raise ValueError("has_initial_state: given exactly when conv_state is")
    if conv_state is not None:
        check_shape("conv_state", conv_state, (num_seqs, channels, weight.shape[1] - 1))
        check_shape("has_initial_state", has_initial_state, (num_seqs,))
        if has_initial_state.dtype != torch.bool:
            raise ValueError(f"has_initial_state: expected bool, got {has_initial_state.dtype}")
    check_same_device(
        x=x, weight=weight, bias=bias, conv_state=conv_state, has_initial_state=has_initial_state
    )


def _final_conv_state(x, cu, conv_state, has_initial_state, width, state_dtype):
    """Each sequence's last K-1 inputs [N, C, K-1], oldest first: its own tokens, and where
    it is shorter than K-1 the carried state shifted in (or zeros). Device ops only."""
    history = width - 1
    num_seqs, channels = cu.shape[0] - 1, x.shape[1]
    if history == 0:
        return torch.zeros((num_seqs, channels, 0), dtype=state_dtype, device=x.device)
    starts, ends = cu[:-1, None], cu[1:, None]
    pos = ends - history + torch.arange(history, device=x.device)  # [N, K-1]
    own = pos >= starts
    values = x[pos.clamp(min=0, max=max(x.shape[0] - 1, 0))] if x.shape[0] else None
    if values is None:
        values = torch.zeros((num_seqs, history, channels), dtype=x.dtype, device=x.device)
    new = values.transpose(1, 2).to(state_dtype)  # [N, C, K-1]
    carried = torch.zeros_like(new)
    if conv_state is not None:
        # Position p before the start sits in state column K-1 - (start - p).
        column = (pos - starts + history).clamp(0, history - 1)
        old = conv_state.gather(2, column[:, None, :].expand(num_seqs, channels, history))
        keep = has_initial_state.to(x.device).view(-1, 1, 1)
        carried = torch.where(keep, old.to(state_dtype), carried)
    return torch.where(own[:, None, :], new, carried).contiguous()
