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

from kvloom.kernels.gated_delta_rule import (
    check_floating,
    check_heads,
    check_shape,
    cu_seqlens_to_list,
    select_initial_state,
)

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
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_rule.chunk_gated_delta_rule` on fla's kernels (see that docstring).

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; cu_seqlens [N+1]; initial_state
    [N, Hv, Dk, Dv] read only where has_initial_state [N] is True. Returns (out [T, Hv, Dv]
    in q's dtype, final_state [N, Hv, Dk, Dv] float32, or initial_state's dtype when given).
    """
    num_tokens, num_v_heads, _, _ = check_heads(q, k, v)
    check_shape("g", g, (num_tokens, num_v_heads))
    check_shape("beta", beta, (num_tokens, num_v_heads))
    check_floating("g", g)
    check_floating("beta", beta)
    return run_fla_varlen(
        lambda: importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule,
        q, k, v, g, beta, cu_seqlens, initial_state, has_initial_state, scale, use_qk_l2norm,
    )  # fmt: skip


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The body both fla wrappers share (gated delta rule, KDA), after their shape checks:
    the NaN-safe initial states, then one varlen launch of `load_kernel()` (imported only
    here, so CPU-only installs never import fla) over all packed tokens."""
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
    kernel = load_kernel()
    cu_cpu = torch.tensor(bounds, dtype=torch.int64)
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
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        cu_seqlens=cu_cpu.to(q.device),
        cu_seqlens_cpu=cu_cpu,  # lets fla lay out chunks without a device-to-host copy
    )
    return out.squeeze(0).to(q.dtype), final_state.to(final_dtype)
