"""The replicas' metrics in one place: ``MetricsBoard``, a Ray actor that keeps each replica's
latest metrics text and the router's decisions, and ``MergedMetrics``, the collector that the
ingress's ``/metrics`` registers (every replica's families merged by name, the router's
counts added)."""

from __future__ import annotations

import time

from prometheus_client.core import CounterMetricFamily
from prometheus_client.parser import text_string_to_metric_families

STALE_S = 5.0  # a replica silent this long is gone (its metrics leave /metrics)


class MetricsBoard:
    """A Ray actor, named ``BOARD`` in Serve's namespace: each replica's latest metrics text
    (with when it came: a replica that has not published for ``STALE_S`` is gone), and the
    router's decisions, counted by replica and reason."""

    def __init__(self):
        self.texts: dict[str, tuple[float, str, int]] = {}  # (when, metrics, requests in it)
        self.routed: dict[tuple[str, str], int] = {}
        self.draining = False

    def put(self, name: str, text: str, unfinished: int) -> None:
        self.texts[name] = (time.monotonic(), text, unfinished)

    def drain(self) -> None:
        """The server is stopping: the ingress takes no new request."""
        self.draining = True

    def is_draining(self) -> bool:
        return self.draining

    def unfinished(self) -> int:
        """Requests in the live replicas, as they last said."""
        now = time.monotonic()
        return sum(n for t, _, n in self.texts.values() if now - t < STALE_S)

    def count(self, replica: str, reason: str) -> None:
        self.routed[(replica, reason)] = self.routed.get((replica, reason), 0) + 1

    def snapshot(self) -> tuple[list[str], dict]:
        """(the live replicas' texts, the router's counts)."""
        now = time.monotonic()
        live = [text for t, text, _ in self.texts.values() if now - t < STALE_S]
        return live, dict(self.routed)


class MergedMetrics:
    """A collector of the replicas' metric families, merged by name, and the router's."""

    def __init__(self, texts: list[str], routed: dict, model_name: str):
        self.texts, self.routed, self.model_name = texts, routed, model_name

    def collect(self):
        families: dict = {}  # (name, type) -> the first replica's family, the others' samples added
        for text in self.texts:
            for fam in text_string_to_metric_families(text):
                key = (fam.name, fam.type)
                if key in families:
                    families[key].samples += fam.samples
                else:
                    families[key] = fam
        yield from families.values()
        routed = CounterMetricFamily(
            "pagedllm:router_requests",
            "requests the router sent to each engine replica, and why (prefix, load, turn)",
            labels=["model_name", "engine", "reason"],
        )
        for (replica, reason), n in sorted(self.routed.items()):
            routed.add_metric([self.model_name, replica, reason], n)
        yield routed
