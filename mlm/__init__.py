"""mlm: train large transformer language models the Megatron-LM way.

The core (config, model, parallel, checkpoint, artifact formats) lives in this package; each
stage (`mlm.data`, ...) imports the core and never another stage's internals.
"""

__version__ = "0.1.0"
