"""Chained block hashes for the prefix cache.

hash(block i) = H(hash(block i-1), token ids of block i, extra keys). The chain makes a
hash name the whole prefix, so equal hashes mean equal prefixes; extra keys (such as a
tenant's `cache_salt`) keep caches apart. xxh3-128 is fast and, at 128 bits, collisions
are negligible at any realistic cache size.
"""

from __future__ import annotations

from array import array

import xxhash

ROOT_HASH = b"kvloom-root"


def hash_block(parent: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    h = xxhash.xxh3_128()
    h.update(parent if parent is not None else ROOT_HASH)
    h.update(array("q", token_ids).tobytes())
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    return h.digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: list[int], block_size: int, extra: bytes = b""
) -> None:
    """Appends the hashes of every newly full block of `token_ids` to `hashes`."""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[start : start + block_size], extra))
