"""`mlm serve`: the OpenAI-compatible HTTP API (and Megatron's `PUT /api`) over `mlm.inference`."""
