"""torchtitan → mlm: `mlm convert from-torchtitan` (`importer`: a Llama 3 DCP step folder with its
AdamW state, data position and scheduler). See docs/torchtitan.md.
"""
