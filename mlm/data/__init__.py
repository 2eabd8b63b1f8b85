"""The data stage: raw text → tokenizer → Megatron indexed dataset (+ merge, inspect, index)."""
