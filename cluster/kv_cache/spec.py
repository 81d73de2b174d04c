"""KV-cache specs: what one layer keeps per token (or per request), and its page size.

Layers with equal specs form a KV-cache group with one block table per request. All
groups draw pages from one block pool; `page_layout.py` maps it onto shared buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
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

    `block_size` is the token granularity at which state checkpoints may be cached
    (align mode); a request's live state occupies one page.
    """

    block_size: int
    conv_state_shape: tuple[int, ...]
    recurrent_state_shape: tuple[int, ...]
    dtype: str
    state_dtype: str = "float32"

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


def group_layers(layer_specs: dict[str, KVCacheSpec]) -> list[KVCacheGroup]:
    """Layers with equal specs share a group (and a block table per request)."""
    groups: list[KVCacheGroup] = []
    for name, spec in layer_specs.items():
        for group in groups:
            if group.spec == spec:
                group.layer_names.append(name)
                break
        else:
            groups.append(KVCacheGroup(spec, [name]))
    return groups
