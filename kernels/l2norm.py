"""L2 normalisation of query/key vectors, as the linear-attention kernels apply it.

Both Qwen3-Next (Gated DeltaNet) and Kimi-Linear (KDA) normalise q and k "in the kernel", in
float32 or wider, with the epsilon added to the squared norm (not clamped as
`F.normalize` does). Transformers writes it as `x * rsqrt(s + eps)` for Qwen3-Next and as
`x / sqrt(s + eps)` for Kimi-Linear; the two agree up to the last rounding bit.
"""

import torch

from kvloom.kernels.dispatch import use_triton

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """Divide each vector along the last dimension by sqrt(sum of squares + eps)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def l2norm_rows(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """q or k [T, H, D] normalised per head vector, summed in float32 (float64 stays
    float64) and returned contiguous in x's dtype: one Triton launch on CUDA
    (`l2norm_triton`, a fixed plan), else torch."""
    if x.dim() != 3:
        raise ValueError(f"x: expected [tokens, heads, dim], got shape {list(x.shape)}")
    if use_triton(x):
        from kvloom.kernels.l2norm_triton import l2norm_rows_triton

        return l2norm_rows_triton(x, eps)
    wide = x.double() if x.dtype == torch.float64 else x.float()
    return l2norm(wide, eps).to(x.dtype).contiguous()
