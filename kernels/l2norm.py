"""L2 normalisation of query/key vectors, as the linear-attention kernels apply it.

Both Qwen3-Next (Gated DeltaNet) and Kimi-Linear (KDA) normalise q and k "in the kernel", in
float32 or wider, with the epsilon added to the squared norm (not clamped as
`F.normalize` does). Transformers writes it as `x * rsqrt(s + eps)` for Qwen3-Next and as
`x / sqrt(s + eps)` for Kimi-Linear; the two agree up to the last rounding bit.
"""

import torch

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """Divide each vector along the last dimension by sqrt(sum of squares + eps)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)
