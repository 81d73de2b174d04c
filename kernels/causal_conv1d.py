"""Depthwise causal conv1d over packed sequences, with a carried conv state (pure torch).

Linear-attention layers (Qwen3-Next GDN, Kimi-Linear KDA) run their q/k/v projections through
a depthwise causal convolution of width K before the recurrence; output t of a sequence is

    y_t = act(bias + sum_{j<K} weight[:, j] * x_{t-K+1+j})

where inputs before the sequence's first token come from its conv state (or are zeros).

State layout: [N or num_slots, C, K-1], channel-major, oldest input first: the last K-1
inputs of the sequence. transformers' cache keeps K columns ([B, C, K]) and its oldest column
never reaches an output, so our state equals its `conv_state[..., 1:]`.
Weight layout: [C, K], i.e. nn.Conv1d's [C, 1, K] weight squeezed, as transformers passes it.

Computation runs in float32, or float64 for float64 input; y has x's dtype and a returned
state has the dtype of the state it continues (x's dtype when there is none).
"""

import torch
import torch.nn.functional as F

from kvloom.kernels.gated_delta_rule import (
    check_floating,
    check_shape,
    check_state_indices,
    cu_seqlens_to_list,
    select_initial_state,
)

_ACTIVATIONS = {None: lambda y: y, "silu": F.silu, "swish": F.silu}


def _activation(activation: str | None):
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation: expected one of {list(_ACTIVATIONS)}, got {activation!r}")
    return _ACTIVATIONS[activation]


def _check_params(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """Validate x [rows, C], weight [C, K], bias [C]; return K."""
    check_shape("x", x, (None, None))
    check_floating("x", x)
    check_shape("weight", weight, (x.shape[1], None))
    if weight.shape[1] < 1:
        raise ValueError("weight: kernel width must be at least 1")
    if bias is not None:
        check_shape("bias", bias, (x.shape[1],))
    return weight.shape[1]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal conv over N packed sequences (prefill, or prefill chunks that resume).

    x [T, C]; cu_seqlens [N+1]; conv_state [N, C, K-1] (gathered by the caller) is read only
    where has_initial_state [N] (bool) is True, else the sequence starts after zeros;
    conv_state=None means all start after zeros. Returns (y [T, C], new_conv_state
    [N, C, K-1]): the last K-1 inputs of each sequence, old state (or zeros) shifted in
    where the sequence is shorter than K-1.
    """
    width = _check_params(x, weight, bias)
    act = _activation(activation)
    bounds = cu_seqlens_to_list(cu_seqlens, x.shape[0])
    num_seqs, channels, history = len(bounds) - 1, x.shape[1], width - 1
    dtype = _compute_dtype(x)
    prefix = select_initial_state(
        conv_state, has_initial_state, (num_seqs, channels, history), dtype, x.device, "conv_state"
    )
    # One extended row block per sequence: its K-1 carried inputs, then its tokens. Sequence
    # n's block starts at bounds[n] + n * (K-1), so token t sits at t + (n + 1) * (K-1).
    lens = torch.tensor([b - a for a, b in zip(bounds, bounds[1:])], dtype=torch.int64)
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), lens).to(x.device)
    block_start = torch.tensor(bounds[:-1], dtype=torch.int64, device=x.device)
    block_start = block_start + torch.arange(num_seqs, device=x.device) * history
    steps = torch.arange(history, device=x.device)
    extended = x.new_zeros(x.shape[0] + num_seqs * history, channels, dtype=dtype)
    extended[block_start.view(-1, 1) + steps] = prefix.transpose(1, 2)
    token_row = torch.arange(x.shape[0], device=x.device) + (seq_of_token + 1) * history
    extended[token_row] = x.to(dtype)

    windows = extended[(token_row - history).view(-1, 1) + torch.arange(width, device=x.device)]
    y = torch.einsum("tkc,ck->tc", windows, weight.to(dtype))
    if bias is not None:
        y = y + bias.to(dtype)
    tail_start = block_start + lens.to(x.device)
    new_state = extended[tail_start.view(-1, 1) + steps].transpose(1, 2)
    state_dtype = x.dtype if conv_state is None else conv_state.dtype
    return act(y).to(x.dtype), new_state.to(state_dtype).contiguous()


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One new input per sequence (decode). x [N, C]; conv_state_pool [num_slots, C, K-1] is
    updated in place at rows state_indices [N]; a negative index marks a padding row: its slot
    is not touched and its output is zeros. Returns y [N, C]."""
    width = _check_params(x, weight, bias)
    act = _activation(activation)
    check_shape("conv_state_pool", conv_state_pool, (None, x.shape[1], width - 1))
    check_floating("conv_state_pool", conv_state_pool)
    check_state_indices(state_indices, x.shape[0], conv_state_pool.shape[0])
    dtype = _compute_dtype(x)
    rows = torch.nonzero(state_indices >= 0).flatten()
    slots = state_indices[rows].to(torch.int64).to(conv_state_pool.device)
    window = torch.cat([conv_state_pool[slots].to(dtype), x[rows].to(dtype).unsqueeze(-1)], -1)
    y_rows = (window * weight.to(dtype)).sum(-1)
    if bias is not None:
        y_rows = y_rows + bias.to(dtype)
    conv_state_pool[slots] = window[..., 1:].to(conv_state_pool.dtype)
    y = x.new_zeros(x.shape, dtype=dtype)
    y[rows] = act(y_rows)
    return y.to(x.dtype)
