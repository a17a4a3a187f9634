"""``GET /metrics``: the engine's state and latencies in Prometheus text, with vLLM's metric names
under this project's prefix (``vllm:num_requests_running`` -> ``pagedllm:num_requests_running``).

``PrometheusStatLogger`` is one of ``AsyncLLM``'s stat loggers: it runs on the engine thread
after every step (prometheus_client's metrics are thread-safe) and owns its own registry, so
several servers in one process do not collide.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from engine.core.messages import TIER_FIELDS
from engine.frontend.async_llm import StepStats

PREFIX = "pagedllm:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0)
# the engine's cumulative counts that become counters (by their increments)
CUMULATIVE = ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits")
CUMULATIVE += ("external_prefix_cache_queries", "external_prefix_cache_hits")
EXTERNAL = {  # vLLM's names for the KV connector's counters -> StepStats' fields
    "external_prefix_cache_queries": "tier_queries",
    "external_prefix_cache_hits": "tier_hits",
}
TIER_COUNTERS = {  # per KV tier (label ``tier``: host, disk)
    "queries": "KV blocks looked up in the tier (those the tiers above did not hold)",
    "hits": "KV blocks found in the tier",
    "loads": "KV blocks loaded from the tier into the pool",
    "load_bytes": "bytes loaded from the tier",
    "stores": "KV blocks stored in the tier",
    "store_bytes": "bytes stored in the tier",
    "evictions": "KV blocks dropped from the tier to stay within its size",
    "rejected": "stored blocks that failed their checks (the disk tier's files)",
}
TIER_GAUGES = {
    "usage_bytes": "bytes the tier holds",
    "capacity_bytes": "bytes the tier may hold",
}


class ExpertTokens:
    """``pagedllm:moe_expert_tokens_total{layer, expert}``: the rows a mixture of experts'
    router sent to each expert of each sparse layer. The engine's cumulative counts are kept as
    they come (a reference per step) and turned into series only when /metrics is read."""

    def __init__(self, names: list[str], values: list[str]):
        self.names, self.values = names, values
        self.latest: list | None = None  # CoreStats.expert_tokens

    def collect(self):
        if self.latest is None:
            return
        family = CounterMetricFamily(
            PREFIX + "moe_expert_tokens",
            "token rows routed to each expert, per sparse layer",
            labels=[*self.names, "layer", "expert"],
        )
        for layer, *counts in self.latest:
            for expert, n in enumerate(counts):
                family.add_metric([*self.values, str(layer), str(expert)], n)
        yield family


class PrometheusStatLogger:
    """``engine``: a replica's name, an ``engine`` label on every metric (data parallel)."""

    def __init__(self, model_name: str, engine: str | None = None):
        self.registry = CollectorRegistry()
        names = ["model_name"] + ([] if engine is None else ["engine"])
        self.label_values = [model_name] + ([] if engine is None else [engine])
        labels = dict(labelnames=names, registry=self.registry)
        gauge = {
            "num_requests_running": "sequences in the running queue",
            "num_requests_waiting": "sequences waiting to be scheduled",
            "num_requests_swapped": "sequences swapped out to CPU blocks",
            "kv_cache_usage_perc": "fraction of GPU KV blocks in use (1 = full)",
            "prefix_cache_hit_rate": "prompt tokens found in the prefix cache / looked up",
        }
        counter = {
            "num_preemptions": "preemptions so far",
            "prompt_tokens": "prompt tokens of requests that started generating, or were "
            "pooled (embeddings, scores)",
            "generation_tokens": "generated tokens",
            "prefix_cache_queries": "prompt tokens looked up in the prefix cache",
            "prefix_cache_hits": "prompt tokens found in the prefix cache",
            "external_prefix_cache_queries": "prompt tokens looked up in the KV tiers",
            "external_prefix_cache_hits": "prompt tokens loaded from the KV tiers",
            "request_success": "requests finished",
            "spec_decode_num_drafts": "speculated steps of a sequence (drafts verified)",
            "spec_decode_num_draft_tokens": "draft tokens proposed",
            "spec_decode_num_accepted_tokens": "draft tokens accepted",
        }
        hist = {
            "time_to_first_token_seconds": ("arrival -> first token", LATENCY_BUCKETS),
            "inter_token_latency_seconds": ("time between tokens", LATENCY_BUCKETS),
            "e2e_request_latency_seconds": ("arrival -> finish", E2E_BUCKETS),
        }
        self.gauges = {k: Gauge(PREFIX + k, h, **labels) for k, h in gauge.items()}
        self.counters = {k: Counter(PREFIX + k, h, **labels) for k, h in counter.items()}
        self.hists = {
            k: Histogram(PREFIX + k, h, buckets=b, **labels) for k, (h, b) in hist.items()
        }
        self.per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "draft tokens accepted, by position in the draft",
            labelnames=[*names, "position"],
            registry=self.registry,
        )
        tier = dict(labelnames=[*names, "tier"], registry=self.registry)
        self.tier_counters = {
            k: Counter(PREFIX + "kv_tier_" + k, h, **tier) for k, h in TIER_COUNTERS.items()
        }
        self.tier_gauges = {
            k: Gauge(PREFIX + "kv_tier_" + k, h, **tier) for k, h in TIER_GAUGES.items()
        }
        self.lora_info = Gauge(
            PREFIX + "lora_requests_info",
            "LoRA adapters of the running and waiting requests (the value: when it was seen)",
            labelnames=[*names, "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            registry=self.registry,
        )
        self.experts = ExpertTokens(names, self.label_values)
        self.registry.register(self.experts)
        for metric in [*self.gauges.values(), *self.counters.values(), *self.hists.values()]:
            metric.labels(*self.label_values)  # every series from the start, at 0
        self._seen: dict = {}  # a cumulative engine count's key -> its value at the last step

    def __call__(self, s: StepStats) -> None:
        m = self.label_values
        self.gauges["num_requests_running"].labels(*m).set(s.num_running)
        self.gauges["num_requests_waiting"].labels(*m).set(s.num_waiting)
        self.gauges["num_requests_swapped"].labels(*m).set(s.num_swapped)
        self.gauges["kv_cache_usage_perc"].labels(*m).set(s.kv_cache_usage)
        rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        self.gauges["prefix_cache_hit_rate"].labels(*m).set(rate)
        for name in CUMULATIVE:
            self._advance(
                self.counters[name].labels(*m), name, getattr(s, EXTERNAL.get(name, name))
            )
        self.counters["prompt_tokens"].labels(*m).inc(s.prompt_tokens)
        self.counters["generation_tokens"].labels(*m).inc(s.generation_tokens)
        for out in s.finished:
            self._observe(out.metrics)
        if s.spec_decode is not None:
            self._spec(s.spec_decode)
        if s.kv_tiers is not None:
            self._tiers(s.kv_tiers)
        if s.expert_tokens is not None:
            self.experts.latest = s.expert_tokens
        if s.lora_running is not None:  # vLLM's shape: the adapters in labels, the time as value
            running, waiting = ",".join(s.lora_running), ",".join(s.lora_waiting)
            labels = [*self.label_values, running, waiting, str(s.max_loras)]
            self.lora_info.labels(*labels).set(time.time())

    def _tiers(self, tiers: list) -> None:
        """Each KV tier's cumulative counters -> increments; its fill as gauges."""
        for row in tiers:
            t = dict(zip(TIER_FIELDS, row, strict=True))
            m = [*self.label_values, t["name"]]
            for k in TIER_COUNTERS:
                self._advance(self.tier_counters[k].labels(*m), ("tier", t["name"], k), t[k])
            self.tier_gauges["usage_bytes"].labels(*m).set(t["used_bytes"])
            self.tier_gauges["capacity_bytes"].labels(*m).set(t["capacity_bytes"])

    def _spec(self, st) -> None:
        """Speculative decoding's cumulative counters -> increments."""
        m = self.label_values
        now = {
            "spec_decode_num_drafts": st.num_drafts,
            "spec_decode_num_draft_tokens": st.num_draft_tokens,
            "spec_decode_num_accepted_tokens": st.num_accepted_tokens,
        }
        now |= {("pos", i): n for i, n in enumerate(st.accepted_per_pos)}
        for key, value in now.items():
            pos = isinstance(key, tuple)
            series = self.per_pos.labels(*m, str(key[1])) if pos else self.counters[key].labels(*m)
            self._advance(series, key, value)

    def _advance(self, series, key, value) -> None:
        """A cumulative engine count -> its counter's increment since the last step."""
        series.inc(max(value - self._seen.get(key, 0), 0))
        self._seen[key] = value

    def _observe(self, metrics) -> None:
        m = self.label_values
        self.counters["request_success"].labels(*m).inc()
        if metrics.ttft is not None:
            self.hists["time_to_first_token_seconds"].labels(*m).observe(metrics.ttft)
        for gap in metrics.itl:
            self.hists["inter_token_latency_seconds"].labels(*m).observe(gap)
        if metrics.e2e_latency is not None:
            self.hists["e2e_request_latency_seconds"].labels(*m).observe(metrics.e2e_latency)

    def render(self) -> bytes:
        return generate_latest(self.registry)
