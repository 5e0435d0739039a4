"""Prometheus metrics of the HTTP server (``GET /metrics``), through ``prometheus_client``.

Latency histograms and finished requests are measured by the server as responses go out. The
engine's own counters and gauges (tokens, queue lengths, cache usage, prefix-cache hits,
preemptions, speculative acceptance) live in ``EngineStats``; a collector reads them at scrape time instead of copying
them into client-side metrics on every step. Each ``ServerMetrics`` has its own registry, so
several apps in one process (tests) never share or collide on a metric. Several server processes
(``api_servers.py``) share a ``metrics_dir``: prometheus_client's multiprocess mode, each scrape
sums the processes' histograms and counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from openk3.serve.engine import EngineStats


class _EngineCollector:
    """The engine's counters and gauges, read from ``stats()`` at every scrape."""

    def __init__(self, stats: Callable[[], EngineStats]):
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        yield CounterMetricFamily("openk3_prompt_tokens_total",
                                  "Prompt tokens computed (prefix-cache hits excluded).", value=s.prompt_tokens)
        yield CounterMetricFamily("openk3_generation_tokens_total", "Tokens generated.", value=s.generation_tokens)
        yield GaugeMetricFamily("openk3_num_requests_running", "Requests in the running batch.", value=s.num_running)
        yield GaugeMetricFamily("openk3_num_requests_waiting", "Requests queued for admission.", value=s.num_waiting)
        yield GaugeMetricFamily("openk3_cache_usage_ratio", "Fraction of MLA cache blocks held by requests.",
                                value=s.cache_usage)
        yield CounterMetricFamily("openk3_prefix_cache_queries_total", "Admissions that looked up the prefix cache.",
                                  value=s.prefix_queries)
        yield CounterMetricFamily("openk3_prefix_cache_hits_total", "Prefix-cache lookups that hit.",
                                  value=s.prefix_hits)
        yield GaugeMetricFamily("openk3_prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries.",
                                value=s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0)
        yield CounterMetricFamily("openk3_prefix_cache_saved_tokens_total", "Prefill tokens skipped thanks to hits.",
                                  value=s.prefix_tokens_saved)
        yield CounterMetricFamily("openk3_num_preemptions_total", "Requests preempted for lack of cache.",
                                  value=s.num_preemptions)
        yield CounterMetricFamily("openk3_engine_steps_total", "Scheduler steps that ran a forward pass.",
                                  value=s.num_steps)
        yield CounterMetricFamily("openk3_engine_step_seconds_total", "Wall time inside engine steps.",
                                  value=s.step_seconds)
        yield CounterMetricFamily("openk3_engine_prefill_steps_total", "Engine steps that computed prompt tokens.",
                                  value=s.prefill_steps)
        yield CounterMetricFamily("openk3_engine_prefill_step_seconds_total",
                                  "Wall time inside engine steps that computed prompt tokens.",
                                  value=s.prefill_step_seconds)
        yield CounterMetricFamily("openk3_spec_verifications_total",
                                  "Speculative decoding: sequence-steps whose drafts were verified.",
                                  value=s.spec_verifications)
        yield CounterMetricFamily("openk3_spec_draft_tokens_total", "Speculative decoding: draft tokens proposed.",
                                  value=s.spec_draft_tokens)
        yield CounterMetricFamily("openk3_spec_accepted_tokens_total", "Speculative decoding: draft tokens accepted.",
                                  value=s.spec_accepted_tokens)
        yield GaugeMetricFamily("openk3_spec_acceptance_rate", "spec_accepted_tokens / spec_draft_tokens.",
                                value=s.spec_acceptance_rate)
        yield GaugeMetricFamily("openk3_spec_mean_accepted_tokens",
                                "Accepted draft tokens per verified sequence-step (each emits one more).",
                                value=s.spec_mean_accepted_tokens)


class ServerMetrics:
    """One server's metrics: ``ttft`` / ``itl`` / ``e2e`` histograms (seconds) and ``finished``
    (by finish reason) are observed by the server; ``render`` adds the engine's at scrape time."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine_stats: Callable[[], EngineStats], metrics_dir: str | None = None):
        if metrics_dir is not None and values.ValueClass is values.MutexValue:
            raise RuntimeError("ServerMetrics(metrics_dir=...): prometheus_client was imported "
                               "before PROMETHEUS_MULTIPROC_DIR was set (api_servers.py sets it first)")
        self.metrics_dir = metrics_dir
        self.registry = CollectorRegistry()
        self.ttft = Histogram("openk3_time_to_first_token_seconds", "Request arrival to first token.",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80),
                              registry=self.registry)
        self.itl = Histogram("openk3_inter_token_latency_seconds", "Time between consecutive tokens.",
                             buckets=(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5),
                             registry=self.registry)
        self.e2e = Histogram("openk3_e2e_request_latency_seconds", "Request arrival to last token.",
                             buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320), registry=self.registry)
        self.finished = Counter("openk3_requests_finished_total",
                                "Requests ended, by finish reason (abort: the client left, or the engine failed).",
                                ["finish_reason"], registry=self.registry)
        self.engine = _EngineCollector(engine_stats)
        self.registry.register(self.engine)

    def render(self) -> bytes:
        """Every metric in the Prometheus text format (``content_type``)."""
        if self.metrics_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()  # every process's, summed; the engine's once
        MultiProcessCollector(registry, self.metrics_dir)
        registry.register(self.engine)
        return generate_latest(registry)
