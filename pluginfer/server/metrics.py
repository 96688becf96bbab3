"""Prometheus metrics of one server, in a registry of its own (two apps in a process do not mix)."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from pluginfer.engine.client import EngineClient
from pluginfer.engine.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """Counters and histograms the handlers feed; the engine's ``EngineStats`` read when scraped."""

    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.requests = Counter("pluginfer_requests", "HTTP requests answered, by route and status code",
                                ["route", "status"], registry=registry)
        self.prompt_tokens = Counter("pluginfer_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=registry)
        self.generation_tokens = Counter("pluginfer_generation_tokens", "Tokens generated", registry=registry)
        self.time_to_first_token = Histogram(
            "pluginfer_time_to_first_token_seconds", "From arrival to the first generated token",
            buckets=_LATENCY_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram(
            "pluginfer_inter_token_latency_seconds",
            "Between two generated tokens of one request as delivered (tokens that arrive together share the gap)",
            buckets=_LATENCY_BUCKETS, registry=registry)
        Gauge("pluginfer_num_requests_running", "Sequences in the running batch",
              registry=registry).set_function(lambda: engine.stats.num_running)
        Gauge("pluginfer_num_requests_waiting", "Sequences waiting to be scheduled",
              registry=registry).set_function(lambda: engine.stats.num_waiting)
        Gauge("pluginfer_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0 to 1)",
              registry=registry).set_function(lambda: engine.stats.kv_cache_usage)
        Gauge("pluginfer_kv_cache_free_blocks", "KV-cache blocks no sequence holds (prefix-cached ones included)",
              registry=registry).set_function(lambda: engine.stats.num_free_blocks)
        Gauge("pluginfer_kv_cache_blocks", "KV-cache blocks in all",
              registry=registry).set_function(lambda: engine.stats.num_blocks)
        registry.register(_EngineCounters(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


class _EngineCounters(Collector):
    """The engine's counters (kept by the engine, so not prometheus_client Counters this process increments)."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self.engine.stats
        yield CounterMetricFamily("pluginfer_num_preemptions", "Sequences preempted (their KV blocks given up)",
                                  value=stats.num_preemptions)
        yield CounterMetricFamily("pluginfer_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=stats.prefix_cache_queries)
        yield CounterMetricFamily("pluginfer_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  value=stats.prefix_cache_hits)
        yield CounterMetricFamily("pluginfer_spec_decode_num_drafts", "Speculative decoding: decodes given drafts",
                                  value=stats.spec_drafts)
        yield CounterMetricFamily("pluginfer_spec_decode_num_draft_tokens", "Speculative decoding: draft tokens",
                                  value=stats.spec_draft_tokens)
        yield CounterMetricFamily("pluginfer_spec_decode_num_accepted_tokens",
                                  "Speculative decoding: draft tokens the model agreed with",
                                  value=stats.spec_accepted_tokens)
        drafts, tokens, accepted = stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens
        yield GaugeMetricFamily("pluginfer_spec_decode_acceptance_rate",
                                "Speculative decoding: accepted draft tokens over draft tokens, since the start",
                                value=accepted / tokens if tokens else 0.0)
        yield GaugeMetricFamily("pluginfer_spec_decode_mean_accepted_length",
                                "Speculative decoding: tokens a drafted decode step produced on average (its accepted "
                                "drafts and the model's own next token), since the start",
                                value=1 + accepted / drafts if drafts else 0.0)


class RequestTimer:
    """Watches one engine request's outputs: first-token and inter-token latency, token counts."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.last: float | None = None
        self.num_prompt_tokens = 0
        self.num_generated = 0

    def observe(self, output: RequestOutput) -> None:
        self.num_prompt_tokens = len(output.prompt_token_ids)
        generated = sum(len(choice.token_ids) for choice in output.outputs)
        if generated <= self.num_generated:
            return
        now = time.monotonic()
        new = generated - self.num_generated
        if self.last is None:
            self.metrics.time_to_first_token.observe(now - self.start)
            gap, new = 0.0, new - 1  # tokens that came with the first arrived with it
        else:
            gap = (now - self.last) / new
        # one sample a token, whether a step's outputs arrive one by one or coalesced (a busy consumer, drafts)
        for _ in range(new):
            self.metrics.inter_token_latency.observe(gap)
        self.last, self.num_generated = now, generated

    def close(self) -> None:
        """Count the request's tokens, however it ended."""
        self.metrics.prompt_tokens.inc(self.num_prompt_tokens)
        self.metrics.generation_tokens.inc(self.num_generated)
