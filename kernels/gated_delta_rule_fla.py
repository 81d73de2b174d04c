"""Gated delta rule prefill through fla-core's chunked Triton kernels (CUDA).

Same contract as `gated_delta_rule.chunk_gated_delta_rule` (packed token-major layout, value
head h reads key head h // (Hv // Hk), NaN-safe `has_initial_state` selection); only the
computation moves to fla's `fla.ops.gated_delta_rule.chunk_gated_delta_rule`, which is much
faster on the GPU than the torch reference's triangular solves and gathers.

fla handles grouped value heads natively (it reads key head `i_hv // (HV // H)`, the same
grouping as our `repeat_interleave`), so q/k are passed with their Hk heads, unexpanded.
fla is imported only when called: CPU-only installs never import it.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from kvloom.kernels.device_copy import to_device
from kvloom.kernels.fla_chunk_layout import fla_layout, staged_chunk_layout
from kvloom.kernels.gated_delta_rule import (
    check_floating,
    check_heads,
    check_shape,
    cu_seqlens_to_list,
    select_initial_state,
)
from kvloom.kernels.l2norm import l2norm_rows

# Activation dtypes fla's kernels take; anything else (float64) stays on the reference.
FLA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=1)
def _fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def fla_available() -> bool:
    """fla-core is importable and there is a CUDA device for its kernels."""
    return _fla_installed() and torch.cuda.is_available()


def chunk_gated_delta_rule_fla(
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
    """`gated_delta_rule.chunk_gated_delta_rule` on fla's kernels (see that docstring).

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; cu_seqlens [N+1]; initial_state
    [N, Hv, Dk, Dv] read only where has_initial_state [N] is True. Returns (out [T, Hv, Dv]
    in q's dtype, final_state [N, Hv, Dk, Dv] float32, or initial_state's dtype when given).
    `cu_seqlens_device`: the same bounds on q's device (see `run_fla_varlen`).
    """
    num_tokens, num_v_heads, _, _ = check_heads(q, k, v)
    check_shape("g", g, (num_tokens, num_v_heads))
    check_shape("beta", beta, (num_tokens, num_v_heads))
    check_floating("g", g)
    check_floating("beta", beta)
    # fla's Gated DeltaNet has no graph form: "device" means fla's own layout here.
    layout = "staged" if fla_layout() == "staged" else "fla"
    load = _staged_gdn_kernel if layout == "staged" else _fla_gdn_kernel
    return run_fla_varlen(
        load, q, k, v, g, beta, cu_seqlens, initial_state, has_initial_state, scale,
        use_qk_l2norm, cu_seqlens_device, layout=layout,
    )  # fmt: skip


def _fla_gdn_kernel():
    return importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule


def _staged_gdn_kernel():
    return staged_chunk_gated_delta_rule


def staged_chunk_gated_delta_rule(q, k, v, g, beta, *, chunk_offsets, **kwargs):
    """fla's chunk_gated_delta_rule on a staged layout: it takes the chunks (`chunk_indices`
    in kwargs) and makes the per-sequence offsets itself, on the device with no wait."""
    del chunk_offsets
    kernel = importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    return kernel(q, k, v, g, beta, **kwargs)


def run_fla_varlen(
    load_kernel,
    q,
    k,
    v,
    g,
    beta,
    cu_seqlens,
    initial_state,
    has_initial_state,
    scale,
    use_qk_l2norm,
    cu_seqlens_device=None,
    layout: str = "fla",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The body both fla wrappers share (gated delta rule, KDA), after their shape checks:
    the NaN-safe initial states, then one varlen launch of `load_kernel()` (imported only
    here, so CPU-only installs never import fla) over all packed tokens.

    fla takes the bounds twice, on the host (to lay out chunks) and on the device, and
    copies its chunk layout to the device with a copy that waits for the stream: it keeps
    that layout per bounds object. A layer that passes one int64 host tensor and its device
    copy (`cu_seqlens_device`), the same two objects in every layer of a step, has fla
    wait once per step, not once per layer; without them the bounds are staged here.
    `layout` (kernels/fla_chunk_layout.py): "device" (KDA only: fla's `use_graph` form)
    has fla build that layout on the device in every layer, with no wait; "staged" hands
    the kernel a layout made here (`chunk_indices`, `chunk_offsets`), copied once a step
    with no wait. `use_qk_l2norm`: q and k are normalised here (`l2norm.l2norm_rows`, one
    fixed plan) and reach fla as unit vectors, since fla's own l2norm launch re-runs its
    autotuner at each new size bucket of the step (seconds a time on an H100)."""
    if q.dtype not in FLA_DTYPES:
        raise ValueError(f"q: fla takes float16/bfloat16/float32, got {q.dtype}")
    num_tokens, num_v_heads, head_k, head_v = check_heads(q, k, v)
    bounds = cu_seqlens_to_list(cu_seqlens, num_tokens)
    shape = (len(bounds) - 1, num_v_heads, head_k, head_v)
    # fla reads the initial state as float32 and writes a float32 final state.
    state = select_initial_state(initial_state, has_initial_state, shape, torch.float32, q.device)
    final_dtype = torch.float32 if initial_state is None else initial_state.dtype
    if num_tokens == 0:  # nothing to launch; every sequence keeps its starting state
        return v.new_zeros(v.shape, dtype=q.dtype), state.to(final_dtype)
    cu_cpu, cu_dev = fla_bounds(cu_seqlens, bounds, cu_seqlens_device, q.device)
    if use_qk_l2norm:  # here, not in fla: its autotuned l2norm re-tunes as steps grow
        q, k = l2norm_rows(q), l2norm_rows(k.to(q.dtype))
    kernel = load_kernel()
    layout_args = {}
    if layout == "device":  # fla's graph form, for max_num_seqs sequences: ours are all real
        layout_args = {"use_graph": True, "max_num_seqs": len(bounds) - 1}
    elif layout == "staged":
        indices, offsets = staged_chunk_layout(bounds, cu_dev)
        layout_args = {"chunk_indices": indices, "chunk_offsets": offsets}
    # fla's varlen form: a batch of one holding all packed tokens, sequences cut by cu_seqlens.
    out, final_state = kernel(
        q.unsqueeze(0),
        k.to(q.dtype).unsqueeze(0),
        v.to(q.dtype).unsqueeze(0),
        g.float().unsqueeze(0),  # cumulative log-decays are summed in float32 by fla anyway
        beta.unsqueeze(0),
        scale=head_k**-0.5 if scale is None else scale,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
        cu_seqlens=cu_dev,
        cu_seqlens_cpu=cu_cpu,  # lets fla lay out chunks without a device-to-host copy
        **layout_args,
    )
    return out.squeeze(0).to(q.dtype), final_state.to(final_dtype)


def fla_bounds(cu_seqlens, bounds, cu_seqlens_device, device):
    """(host int64 bounds, device int64 bounds) for fla: the caller's own objects where it
    gave both (so fla's per-object cache hits), else fresh ones, staged through pinned
    memory so the copy does not wait for the stream."""
    if cu_seqlens_device is not None:
        check_shape("cu_seqlens_device", cu_seqlens_device, (len(bounds),))
        if cu_seqlens_device.device != device or cu_seqlens_device.dtype != torch.int64:
            raise ValueError(
                f"cu_seqlens_device: expected int64 on {device}, got "
                f"{cu_seqlens_device.dtype} on {cu_seqlens_device.device}"
            )
        host = cu_seqlens
        if host.is_cuda or host.dtype != torch.int64:
            host = torch.tensor(bounds, dtype=torch.int64)
        return host, cu_seqlens_device
    host = torch.tensor(bounds, dtype=torch.int64)
    return host, to_device(host, torch.int64, device)
