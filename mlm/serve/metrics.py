"""`GET /metrics`: Prometheus text. Requests by endpoint and status, tokens, finished requests by
reason, queue length, batch size, KV-cache blocks and bytes per token, and latency histograms."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mlm.inference.engine import Engine

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "mlm_http_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "mlm_time_to_first_token_seconds", "From arrival to the first token", buckets=_SECONDS, registry=r
        )
        self.latency = Histogram(
            "mlm_request_latency_seconds", "From arrival to the last token", buckets=_SECONDS, registry=r
        )
        self.batch = Histogram(
            "mlm_step_batch_size",
            "Sequences run by each engine step",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.engine: Engine | None = None
        r.register(self)

    def attach(self, engine: Engine) -> None:
        self.engine = engine
        engine.on_step = lambda seqs, tokens: self.batch.observe(seqs)

    def collect(self):
        """The engine's own state, read when scraped."""
        e = self.engine
        if e is None:
            return
        gauges = {
            "mlm_queue_length": ("Requests waiting for a place in the batch", e.num_waiting),
            "mlm_running_sequences": ("Sequences in the running batch", e.num_running),
            "mlm_kv_blocks_used": ("KV-cache blocks in use", e.cache.allocator.num_used),
            "mlm_kv_blocks_total": ("KV-cache blocks in the pool", e.cache.allocator.num_blocks),
            "mlm_kv_cache_bytes_per_token": (
                "KV-cache bytes one token takes over every layer, on each tp rank",
                e.cache.bytes_per_token,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily(
            "mlm_prompt_tokens", "Prompt tokens of finished requests", value=e.prompt_tokens
        )
        yield CounterMetricFamily("mlm_generation_tokens", "Tokens generated", value=e.generated_tokens)
        finished = CounterMetricFamily(
            "mlm_finished_requests", "Requests finished, by reason", labels=["reason"]
        )
        for reason, n in sorted(e.finished.items()):
            finished.add_metric([reason], n)
        yield finished

    def render(self) -> bytes:
        return generate_latest(self.registry)
