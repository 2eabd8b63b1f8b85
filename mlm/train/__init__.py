"""The training stage: `mlm train` (`trainer`, its checkpoints in `checkpointing`, AdamW and its
state in `adamw` and `optimizer`), `mlm parity` (`parity/`), `mlm train --dry-run` and `mlm slurm`."""
