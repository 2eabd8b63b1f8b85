"""TensorRT-LLM checkpoints: `mlm export trtllm` writes them, `mlm convert from-trtllm` reads them back.

`names` is the name and per-rank layout map, `config` writes and reads config.json, `exporter`
exports (staged, checked, verified), `check` validates a folder against the layout, `importer`
reads one back into mlm. See docs/trtllm.md and docs/formats-foreign.md.
"""
