"""Kimi Delta Attention gates (Kimi-Linear): the per-channel log-decay g and beta, the reference.

  g[t, h, k]  = -exp(A_log[h]) * softplus(raw_gate[t, h, k] + dt_bias[h * Dk + k])
                (float32; float64 for float64 input; softplus with beta 1 and threshold 20)
  beta[t, h]  = sigmoid(beta_logits[t, h])  (in beta_logits' dtype: computed in float32 for
                half inputs, rounded once, as torch.sigmoid)

These are the dtypes the KDA kernels take today (`ops.recurrent_kda`, `ops.chunk_kda` and
fla through `kda_fla`): g float32, beta in the activations' dtype.

`kda_gates_ref` is bit for bit what `KimiDeltaAttention.forward` computed as two steps
(`kda.kda_log_decay` then `torch.sigmoid`); `kda_gates_triton` is the one-launch kernel.
"""

from __future__ import annotations

import torch

from kvloom.kernels.kda import kda_log_decay

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_kda_gates_args(raw_gate, A_log, dt_bias, beta_logits) -> tuple[int, int, int]:
    """raw_gate [T, H, Dk], A_log [H], dt_bias [H * Dk], beta_logits [T, H].
    Returns (T, H, Dk)."""
    tensors = (("raw_gate", raw_gate), ("A_log", A_log), ("dt_bias", dt_bias))
    for name, value in (*tensors, ("beta_logits", beta_logits)):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
        if value.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}: expected a floating dtype, got {value.dtype}")
    if raw_gate.dim() != 3:
        raise ValueError(f"raw_gate: expected [T, H, Dk], got shape {list(raw_gate.shape)}")
    tokens, heads, head_k = raw_gate.shape
    expected = (("A_log", A_log, (heads,)), ("dt_bias", dt_bias, (heads * head_k,)))
    for name, value, shape in (*expected, ("beta_logits", beta_logits, (tokens, heads))):
        if tuple(value.shape) != shape:
            raise ValueError(f"{name}: expected shape {list(shape)}, got {list(value.shape)}")
    return tokens, heads, head_k


def kda_gates_ref(
    raw_gate: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, beta_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (g [T, H, Dk] float32 (float64 for float64 raw_gate), beta [T, H] in beta_logits'
    dtype)."""
    check_kda_gates_args(raw_gate, A_log, dt_bias, beta_logits)
    return kda_log_decay(raw_gate, A_log, dt_bias), torch.sigmoid(beta_logits)
