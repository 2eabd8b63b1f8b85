"""The inference engine behind `mlm serve` and `mlm generate`: a paged KV cache, continuous
batching, one forward per step, per-request sampling. See docs/serve-engine.md."""
