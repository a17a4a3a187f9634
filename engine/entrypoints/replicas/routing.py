"""Which replica serves a request: round-robin, least-loaded, or prefix-aware.

A replica's prefix cache helps a request only if the replica has recently seen that request's
prompt prefix. ``PrefixIndex`` remembers, approximately, the prompts each replica was sent: a
prompt is cut into chunks of ``chunk`` token ids, and each chunk is named by the hash of itself
and every chunk before it (as the block manager names its blocks), so two prompts share a
chunk's name exactly when they share everything up to its end. The index maps each name to the
replicas that were sent it, least recently used first out once it holds ``capacity`` names.
The longest prefix a replica holds is found by walking a prompt's names until one that replica
lacks.

``Router.choose`` decides, given each candidate's load (requests in its queue):

    round-robin    the next candidate in turn
    least-loaded   the one with the fewest requests (the first of equals)
    prefix-aware   SGLang's cache-aware policy: when the loads differ by more than
                   ``imbalance`` requests, the least loaded; else the one holding the longest
                   prefix of the prompt (at least one chunk), the least loaded of equals; with
                   no match, the one whose index holds the fewest chunks among those within
                   ``imbalance`` of the least loaded (new prefixes spread over the caches)

and counts each decision by replica and reason ("prefix", "load", "turn"), which ``/metrics``
shows.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter, OrderedDict

import numpy as np

POLICIES = ("round-robin", "least-loaded", "prefix-aware")


def chunk_names(token_ids, chunk: int) -> list[bytes]:
    """The name of each full chunk of the prompt: a hash of it and of every chunk before it."""
    ids = np.asarray(token_ids, np.int64)  # (T,)
    names, prev = [], b""
    for i in range(0, len(ids) - chunk + 1, chunk):
        prev = hashlib.blake2b(prev + ids[i : i + chunk].tobytes(), digest_size=16).digest()
        names.append(prev)
    return names


class PrefixIndex:
    """Chunk names -> the replicas sent them (LRU-bounded at ``capacity`` names)."""

    def __init__(self, chunk: int = 16, capacity: int = 100_000):
        self.chunk, self.capacity = chunk, capacity
        self.names: OrderedDict[bytes, set[str]] = OrderedDict()
        self.held: Counter = Counter()  # replica -> names it holds (its cache's size, roughly)

    def insert(self, token_ids, replica: str) -> None:
        for name in chunk_names(token_ids, self.chunk):
            holders = self.names.setdefault(name, set())
            if replica not in holders:
                holders.add(replica)
                self.held[replica] += 1
            self.names.move_to_end(name)
        while len(self.names) > self.capacity:
            for r in self.names.popitem(last=False)[1]:
                self.held[r] -= 1

    def match(self, token_ids, replicas) -> dict[str, int]:
        """Tokens of the prompt's longest prefix (whole chunks) that each replica was sent."""
        best = dict.fromkeys(replicas, 0)
        alive = set(best)
        for i, name in enumerate(chunk_names(token_ids, self.chunk)):
            holders = self.names.get(name)
            alive &= holders or set()
            if not alive:
                break
            for r in alive:
                best[r] = (i + 1) * self.chunk
        return best

    def forget(self, replica: str) -> None:
        """A replica that died: its cache is gone."""
        for name in [n for n, rs in self.names.items() if replica in rs]:
            self.names[name].discard(replica)
            if not self.names[name]:
                del self.names[name]
        self.held.pop(replica, None)


class Router:
    """One policy's decisions; ``routed``: (replica, reason) -> requests."""

    def __init__(self, policy: str = "prefix-aware", imbalance: int = 4, chunk: int = 16):
        if policy not in POLICIES:
            raise ValueError(f"router must be one of {', '.join(POLICIES)}; got {policy!r}")
        if imbalance < 0:
            raise ValueError(f"router imbalance must be >= 0, got {imbalance}")
        self.policy, self.imbalance = policy, imbalance
        self.index = PrefixIndex(chunk)
        self.turn = itertools.count()
        self.routed: Counter = Counter()

    def choose(self, token_ids, loads: dict[str, int]) -> tuple[str, str]:
        """``decide``, then ``record`` the decision."""
        pick, reason = self.decide(token_ids, loads)
        self.record(token_ids, pick, reason)
        return pick, reason

    def decide(self, token_ids, loads: dict[str, int]) -> tuple[str, str]:
        """(replica, reason) among ``loads``' keys (in a stable order), for this prompt."""
        if not loads:
            raise ValueError("no replica to route to")
        replicas = sorted(loads)
        least = min(replicas, key=lambda r: loads[r])
        if self.policy == "round-robin":
            return replicas[next(self.turn) % len(replicas)], "turn"
        if self.policy == "least-loaded":
            return least, "load"
        return self._prefix_aware(token_ids, loads, replicas, least)

    def record(self, token_ids, replica: str, reason: str) -> None:
        """The prompt went to ``replica``: remember it there, count why."""
        self.index.insert(token_ids, replica)
        self.routed[(replica, reason)] += 1

    def _prefix_aware(self, token_ids, loads, replicas, least) -> tuple[str, str]:
        if max(loads.values()) - loads[least] > self.imbalance:
            return least, "load"
        matched = self.index.match(token_ids, replicas)
        longest = max(matched.values())
        if longest == 0:  # a new prefix: to the cache holding least, among the balanced
            fair = [r for r in replicas if loads[r] - loads[least] <= self.imbalance]
            return min(fair, key=lambda r: (self.index.held[r], loads[r])), "load"
        holders = [r for r in replicas if matched[r] == longest]
        return min(holders, key=lambda r: loads[r]), "prefix"

    def forget(self, replica: str) -> None:
        self.index.forget(replica)
