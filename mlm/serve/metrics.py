"""`GET /metrics`: Prometheus text. Requests by endpoint and status, tokens, finished requests by
reason, queue length, batch size, KV-cache blocks and bytes per token, tokens run (prefill and
decode), prefix-cache queries and hits, preemptions, and latency histograms."""

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
        a, st = e.cache.allocator, e.stats
        hit_rate = st.prefix_hits / st.prefix_queries if st.prefix_queries else 0.0
        gauges = {
            "mlm_queue_length": ("Requests waiting for a place in the batch", e.num_waiting),
            "mlm_running_sequences": ("Sequences in the running batch", e.num_running),
            "mlm_kv_blocks_used": ("KV-cache blocks that running sequences reference", a.num_used),
            "mlm_kv_blocks_cached": ("KV-cache blocks holding a cached prefix, in use or not", a.num_cached),
            "mlm_kv_blocks_total": ("KV-cache blocks in the pool", a.num_blocks),
            "mlm_kv_cache_bytes_per_token": (
                "KV-cache bytes one token takes over every layer, on each tp rank",
                e.cache.bytes_per_token,
            ),
            "mlm_prefix_cache_hit_rate": (
                "Prefix-cache hits / queries since the start, in tokens (0 before any query)",
                hit_rate,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily(
            "mlm_prompt_tokens", "Prompt tokens of finished requests", value=e.prompt_tokens
        )
        yield CounterMetricFamily("mlm_generation_tokens", "Tokens generated", value=e.generated_tokens)
        counters = {
            "mlm_prefill_tokens": (
                "Tokens run through the model as prompts or recomputed",
                st.prefill_tokens,
            ),
            "mlm_decode_tokens": (
                "Tokens run through the model one at a time after sampling",
                st.decode_tokens,
            ),
            "mlm_prefix_cache_queries": (
                "Tokens of requests looked up in the prefix cache at their first admission",
                st.prefix_queries,
            ),
            "mlm_prefix_cache_hits": ("Of those, tokens found in the cache (not computed)", st.prefix_hits),
            "mlm_preemptions": ("Running sequences preempted for want of KV-cache blocks", st.preemptions),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        finished = CounterMetricFamily(
            "mlm_finished_requests", "Requests finished, by reason", labels=["reason"]
        )
        for reason, n in sorted(e.finished.items()):
            finished.add_metric([reason], n)
        yield finished

    def render(self) -> bytes:
        return generate_latest(self.registry)
