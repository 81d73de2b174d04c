"""KV-cache specs: what one layer keeps per token (or per request), and its page size.

Workers report their layers' specs; the control plane groups layers with equal specs into
KV-cache groups (one block table per request each) and sizes the pages
(cluster/kv_cache/planner.py). All groups draw pages from one block pool, laid out on
shared buffers as the plan says (contracts/kv_cache_plan.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
# The attention cache dtype `kv_cache_dtype="fp8"` stores (values divided by the layer's
# per-tensor k/v scale): one byte per element, so pages hold twice the bf16 tokens.
FP8_KV_DTYPE = "float8_e4m3fn"
PAGE_ALIGN = 256  # bytes: every view into a shared page starts aligned for any dtype


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int = 0


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention caches one compressed latent + rope key per token."""

    block_size: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: str

    @property
    def page_size_bytes(self) -> int:
        width = self.kv_lora_rank + self.qk_rope_head_dim
        return self.block_size * width * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class LinearStateSpec:
    """Linear attention keeps a fixed-size state per request: conv window + recurrent state.

    `block_size` is the hash granularity of the prefix chain (the attention block size);
    checkpoints are keyed at any token length. A state occupies `pages_per_state`
    consecutive pool pages (set by the planner: attention pages are small, a state spans
    several of them).
    """

    block_size: int
    conv_state_shape: tuple[int, ...]
    recurrent_state_shape: tuple[int, ...]
    dtype: str
    state_dtype: str = "float32"
    pages_per_state: int = 1

    @property
    def conv_bytes(self) -> int:
        """Bytes of the conv window, padded so the recurrent state after it is aligned."""
        conv = math.prod(self.conv_state_shape) * DTYPE_BYTES[self.dtype]
        return -(-conv // PAGE_ALIGN) * PAGE_ALIGN

    @property
    def page_size_bytes(self) -> int:
        recurrent = math.prod(self.recurrent_state_shape) * DTYPE_BYTES[self.state_dtype]
        return self.conv_bytes + recurrent


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MLASpec | LinearStateSpec


@dataclass
class KVCacheGroup:
    spec: KVCacheSpec
    layer_names: list[str]
