"""Stop strings found in text that grows at its end, in time linear in the text added.

``StopStrings(stops)`` is an Aho-Corasick automaton over one request's stop strings, built once;
each sample keeps its own state, a node of the automaton. ``scan`` reads only the characters
added since the last call, however many stop strings there are, and returns the earliest match
that ends in them (the same one ``str.find`` over every stop string would give: the earliest
start, at equal starts the first listed).
"""

from __future__ import annotations

from collections import deque


class StopStrings:
    """The automaton: a trie of the stop strings with failure and output links."""

    def __init__(self, stops: list[str]):
        self.lengths = [len(s) for s in stops]
        self.goto: list[dict[str, int]] = [{}]  # node -> character -> node
        self.ends: list[list[int]] = [[]]  # node -> the stops spelled by the path to it
        for i, stop in enumerate(stops):
            self._insert(i, stop)
        self.fail = [0] * len(self.goto)  # the longest proper suffix that is a trie node
        self.link = [0] * len(self.goto)  # the nearest node on the fail chain that ends a stop
        self._link_all()

    def _insert(self, index: int, stop: str) -> None:
        node = 0
        for ch in stop:
            nxt = self.goto[node].get(ch)
            if nxt is None:
                nxt = self.goto[node][ch] = len(self.goto)
                self.goto.append({})
                self.ends.append([])
            node = nxt
        self.ends[node].append(index)

    def _link_all(self) -> None:
        queue = deque(self.goto[0].values())  # depth 1: fail to the root
        while queue:
            node = queue.popleft()
            for ch, child in self.goto[node].items():
                f = self.fail[node]
                while f and ch not in self.goto[f]:
                    f = self.fail[f]
                self.fail[child] = self.goto[f].get(ch, 0)
                up = self.fail[child]
                self.link[child] = up if self.ends[up] else self.link[up]
                queue.append(child)

    def scan(self, node: int, text: str, start: int) -> tuple[int, tuple[int, int] | None]:
        """Read text[start:] from ``node``: (the node after it, the (start, stop index) of the
        earliest stop ending in it, or None)."""
        goto, fail, ends, link, lengths = self.goto, self.fail, self.ends, self.link, self.lengths
        best = None
        for pos in range(start, len(text)):
            ch = text[pos]
            while node and ch not in goto[node]:
                node = fail[node]
            node = goto[node].get(ch, 0)
            hit = node
            while hit:
                for i in ends[hit]:
                    found = (pos + 1 - lengths[i], i)
                    if best is None or found < best:
                        best = found
                hit = link[hit]
        return node, best
