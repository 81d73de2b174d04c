"""Prefix-cache keys at any token length, and the lengths at which entries exist.

Whole blocks are keyed by the chained block hashes (block_hash.py). A linear-state
checkpoint may sit at any length L, and so may the attention block it ends inside. Its key
names the prefix [0, L): the chain hash at L when L is on a hash-block boundary, else
H(chain hash of the last whole hash block before L, the tokens after it, salt). Equal
keys mean equal prefixes, salts included.

`CheckpointIndex` remembers, per chain position, the tail lengths at which such entries
were published, so a lookup tests only lengths that exist: one dictionary probe per hash
block of the prompt, whatever the prompt's length. The pool tells it when an entry is
evicted.
"""

from __future__ import annotations

from kvloom.cluster.kv_cache.block_hash import hash_block

TAIL_MARK = b"|tail"
ROOT_BASE = b"root|"


def prefix_key(
    block_hashes: list[bytes], token_ids: list[int], length: int, hash_block_size: int, extra
) -> bytes:
    """The key of the prefix [0, length) (length >= 1, its hash blocks already hashed)."""
    full = length // hash_block_size
    if length % hash_block_size == 0:
        return block_hashes[full - 1]
    parent = block_hashes[full - 1] if full else None
    return hash_block(parent, token_ids[full * hash_block_size : length], extra + TAIL_MARK)


class CheckpointIndex:
    def __init__(self, hash_block_size: int):
        self.hash_block_size = hash_block_size
        # base (chain hash of the last whole hash block) -> tail length -> live entries
        self._tails: dict[bytes, dict[int, int]] = {}
        # group-tagged key -> (base, tail length), for removal on eviction
        self._where: dict[bytes, tuple[bytes, int]] = {}

    def __len__(self) -> int:
        return len(self._where)

    @staticmethod
    def base_key(block_hashes: list[bytes], full: int, extra: bytes) -> bytes:
        return block_hashes[full - 1] if full else ROOT_BASE + extra

    def add(self, tagged_key: bytes, block_hashes: list[bytes], length: int, extra: bytes):
        if tagged_key in self._where:
            return
        full, tail = divmod(length, self.hash_block_size)
        base = self.base_key(block_hashes, full, extra)
        self._where[tagged_key] = (base, tail)
        tails = self._tails.setdefault(base, {})
        tails[tail] = tails.get(tail, 0) + 1

    def discard(self, tagged_key: bytes) -> None:
        where = self._where.pop(tagged_key, None)
        if where is None:
            return
        base, tail = where
        tails = self._tails[base]
        tails[tail] -= 1
        if not tails[tail]:
            del tails[tail]
            if not tails:
                del self._tails[base]

    def lengths(
        self, block_hashes: list[bytes], token_ids: list[int], max_tokens: int, extra: bytes
    ) -> dict[int, bytes]:
        """Lengths L <= max_tokens at which some group published an entry on this prefix's
        chain, each with the (untagged) key the request's own tokens give at L."""
        if not self._tails:
            return {}
        size = self.hash_block_size
        out = {}
        for full in range(min(len(block_hashes), max_tokens // size), -1, -1):
            tails = self._tails.get(self.base_key(block_hashes, full, extra))
            for tail in tails or ():
                length = full * size + tail
                if 0 < length <= max_tokens:
                    out[length] = prefix_key(block_hashes, token_ids, length, size, extra)
        return out
