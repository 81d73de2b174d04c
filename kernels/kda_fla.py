"""Kimi Delta Attention prefill through fla-core's chunked Triton kernels (CUDA).

Same contract as `kda.chunk_kda` (packed token-major layout, log-decay g per key channel
computed outside the kernel by `kda_log_decay`, beta already a sigmoid, NaN-safe
`has_initial_state` selection); only the computation moves to `fla.ops.kda.chunk_kda`, the
kernels Kimi-Linear's own modeling code calls when fla is installed, in place of the torch
reference's chunked loop. The gate stays outside (`use_gate_in_kernel=False`), as the
reference has it.

The default on CUDA when fla is installed (`KVLOOM_NO_FLA=1` turns it off): on an H200 it
matched the reference at Kimi-Linear's shape in bf16 and float32, with and without initial
states (`tests/test_kda_fla.py`, marked gpu). fla is imported only when called.

fla cuts each sequence into 64-token chunks and needs that layout (sequence and chunk of
every chunk) on the device. `KVLOOM_FLA_KDA_LAYOUT` says who makes it: fla from the host
bounds, with a copy that waits for the stream once a step (`fla`); fla on the device in
every layer (`device`, its use_graph form); or kvloom on the host once a step, copied
through pinned memory with no wait, handed to fla's forward directly (`staged`).
"""

from __future__ import annotations

import importlib

import numpy as np
import torch

from kvloom.contracts import envs
from kvloom.kernels.gated_delta_rule import check_floating, check_heads, check_shape
from kvloom.kernels.gated_delta_rule_fla import run_fla_varlen


def chunk_kda_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens_device: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kda.chunk_kda` on fla's kernels. q, k [T, Hk, Dk]; v [T, Hv, Dv]; g [T, Hv, Dk]
    (log-decay, <= 0); beta [T, Hv]; cu_seqlens [N+1]; initial_state [N, Hv, Dk, Dv] read
    only where has_initial_state [N]. Returns (out [T, Hv, Dv] in q's dtype, final_state
    [N, Hv, Dk, Dv] float32, or initial_state's dtype when given). `cu_seqlens_device`: the
    same bounds on q's device (`gated_delta_rule_fla.run_fla_varlen`)."""
    num_tokens, num_v_heads, head_k, _ = check_heads(q, k, v)
    check_shape("g", g, (num_tokens, num_v_heads, head_k))
    check_shape("beta", beta, (num_tokens, num_v_heads))
    check_floating("g", g)
    check_floating("beta", beta)
    layout = fla_kda_layout()
    load = _staged_kernel if layout == "staged" else _fla_kernel
    return run_fla_varlen(
        load, q, k, v, g, beta, cu_seqlens, initial_state, has_initial_state, scale,
        use_qk_l2norm, cu_seqlens_device, device_layout=layout == "device",
    )  # fmt: skip


FLA_CHUNK = 64  # fla's KDA chunk (chunk_kda's default)
LAYOUTS = ("fla", "device", "staged")


def fla_kda_layout() -> str:
    """KVLOOM_FLA_KDA_LAYOUT, checked."""
    choice = envs.get("KVLOOM_FLA_KDA_LAYOUT").strip().lower()
    if choice not in LAYOUTS:
        raise ValueError(f"KVLOOM_FLA_KDA_LAYOUT must be fla, device or staged, got {choice!r}")
    return choice


def _fla_kernel():
    return importlib.import_module("fla.ops.kda").chunk_kda


def _staged_kernel():
    return staged_chunk_kda


def chunk_layout(bounds: list[int], chunk: int = FLA_CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """fla's varlen chunk layout from sequence bounds [N+1]: indices [NT, 2] int64 (each
    chunk's sequence and its place in it, sequences in order; an empty sequence has none)
    and offsets [N+1] int64 (each sequence's first chunk; offsets[-1] = NT)."""
    lens = np.diff(np.asarray(bounds, dtype=np.int64))
    if (lens < 0).any():
        raise ValueError(f"cu_seqlens: bounds must not decrease, got {list(bounds)}")
    chunks = -(-lens // chunk)
    offsets = np.concatenate([np.zeros(1, np.int64), np.cumsum(chunks)])
    sequence = np.repeat(np.arange(len(lens), dtype=np.int64), chunks)
    within = np.arange(offsets[-1], dtype=np.int64) - offsets[sequence]
    return np.stack([sequence, within], axis=1), offsets


# The last staged layout, keyed by the device bounds object it was made for: every KDA layer
# of a step passes the same one (`cu_seqlens_device`), so the step copies its layout once.
_last_staged: list = []


def staged_chunk_layout(cu_cpu: torch.Tensor, cu_dev: torch.Tensor):
    """(indices [NT, 2], offsets [N+1]) of `chunk_layout` on cu_dev's device: one staged
    copy (pinned memory, non-blocking), no wait for the stream; the offsets start 16 bytes
    aligned, as a fresh tensor would (indices hold an even number of int64)."""
    if _last_staged and _last_staged[0][0] is cu_dev:
        return _last_staged[0][1]
    indices, offsets = chunk_layout(cu_cpu.tolist())
    host = torch.from_numpy(np.concatenate([indices.reshape(-1), offsets]))
    if cu_dev.device.type == "cuda":
        packed = host.pin_memory().to(cu_dev.device, non_blocking=True)
    else:
        packed = host.to(cu_dev.device)
    layout = (packed[: indices.size].view(-1, 2), packed[indices.size :])
    _last_staged[:] = [(cu_dev, layout)]
    return layout


def staged_chunk_kda(q, k, v, g, beta, *, scale, initial_state, output_final_state,
                     use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu):  # fmt: skip
    """fla's KDA forward (`fla.ops.kda.chunk_fwd.chunk_kda_fwd`, the body of its chunk_kda)
    on the staged chunk layout: chunk_kda's own checks are run_fla_varlen's, and its
    autograd wrapper has nothing to do at inference. Same arguments as chunk_kda's as
    run_fla_varlen passes them; returns (out, final_state)."""
    if use_qk_l2norm_in_kernel:
        raise ValueError("use_qk_l2norm_in_kernel: q and k reach fla normalised")
    indices, offsets = staged_chunk_layout(cu_seqlens_cpu, cu_seqlens)
    forward = importlib.import_module("fla.ops.kda.chunk_fwd").chunk_kda_fwd
    out, final_state, *_ = forward(
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=indices,
        chunk_offsets=offsets, chunk_size=FLA_CHUNK,
    )  # fmt: skip
    return out, final_state
