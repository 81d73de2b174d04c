"""Which data-parallel replica a request goes to.

`prefix` (the default) hashes the prompt's leading blocks with the engine's own block-hash
chain (`cluster/kv_cache/block_hash.py`, `cache_salt` included, the replicas' hash block
size) and sends the request to the replica that most recently served the longest run of
them: the next turn of a conversation, or a request sharing a system prompt, lands where
those blocks are cached. Each replica keeps a bounded LRU table of the block hashes routed
to it (routing history: it needs no events from the replicas). With no such replica, or
when the best one is overloaded, the least loaded replica gets it. `least-loaded` and
`round-robin` are the baselines.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from kvloom.cluster.kv_cache.block_hash import extend_block_hashes

POLICIES = ("prefix", "least-loaded", "round-robin")
TABLE_ENTRIES = 1 << 16  # block hashes remembered per replica (16 B each, plus the dict)
# A prefix hit is worth this many requests of imbalance (each request queued behind the
# others costs roughly one prefill, a hit saves one): past it, balance wins.
MAX_EXTRA_LOAD = 8


@dataclass
class ReplicaLoad:
    """What the router knows of one replica."""

    up: bool = True
    in_flight: int = 0
    routed: int = 0
    routed_by_prefix: int = 0
    table: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    def remember(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.table[h] = None
            self.table.move_to_end(h)
        while len(self.table) > TABLE_ENTRIES:
            self.table.popitem(last=False)

    def matched_blocks(self, hashes: list[bytes]) -> int:
        """Length of the leading run of `hashes` this replica was sent (the chain makes
        a block's hash name its whole prefix, so the first miss ends the run)."""
        for n, h in enumerate(hashes):
            if h not in self.table:
                return n
        return len(hashes)


class Router:
    def __init__(self, num_replicas: int, policy: str = "prefix", hash_block_size: int = 16):
        if policy not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {policy!r}")
        if num_replicas < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {num_replicas}")
        self.policy = policy
        self.hash_block_size = hash_block_size
        self.replicas = [ReplicaLoad() for _ in range(num_replicas)]
        self._turns = itertools.count()

    def choose(self, prompt_token_ids: list[int], cache_salt: str | None = None) -> int | None:
        """The replica for a new request (None: no replica is up); counts it as in flight."""
        up = [i for i, r in enumerate(self.replicas) if r.up]
        if not up:
            return None
        hashes: list[bytes] = []
        if self.policy == "prefix":
            extra = cache_salt.encode() if cache_salt else b""
            extend_block_hashes(hashes, prompt_token_ids, self.hash_block_size, extra)
        chosen, by_prefix = self._pick(up, hashes)
        replica = self.replicas[chosen]
        replica.in_flight += 1
        replica.routed += 1
        replica.routed_by_prefix += by_prefix
        if hashes:
            replica.remember(hashes)
        return chosen

    def _pick(self, up: list[int], hashes: list[bytes]) -> tuple[int, bool]:
        if self.policy == "round-robin":
            return up[next(self._turns) % len(up)], False
        least = min(up, key=lambda i: (self.replicas[i].in_flight, self.replicas[i].routed))
        if self.policy == "least-loaded" or not hashes:
            return least, False
        best = max(up, key=lambda i: (self.replicas[i].matched_blocks(hashes), -i))
        matched = self.replicas[best].matched_blocks(hashes)
        lighter = self.replicas[least].in_flight + MAX_EXTRA_LOAD
        if matched == 0 or self.replicas[best].in_flight > lighter:
            return least, False
        return best, True

    def finished(self, replica: int) -> None:
        self.replicas[replica].in_flight = max(0, self.replicas[replica].in_flight - 1)

    def set_up(self, replica: int, up: bool) -> None:
        """A replica leaves routing when it fails and rejoins, with an empty table (its
        cache is gone), after its restart."""
        state = self.replicas[replica]
        state.up = up
        state.in_flight = 0
        state.table.clear()

    def describe(self) -> list[dict[str, int | bool]]:
        return [
            {
                "up": r.up,
                "in_flight": r.in_flight,
                "routed": r.routed,
                "routed_by_prefix": r.routed_by_prefix,
            }
            for r in self.replicas
        ]
