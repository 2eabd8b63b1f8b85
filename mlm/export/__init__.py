"""TensorRT-LLM checkpoints: `mlm export trtllm` writes them, `mlm convert from-trtllm` reads them back.

`trtllm_names` is the name and per-rank layout map, `trtllm_config` writes and reads config.json,
`trtllm` exports (staged, checked, verified), `trtllm_check` validates a folder against the
layout, `trtllm_import` reads one back into mlm. See docs/export.md and docs/formats.md.
"""
