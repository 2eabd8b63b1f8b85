"""The tiny pipeline, shortened: on the stdlib corpus the loss must visibly fall.

The full demo (`just demo`, 300 steps) ends below 4.5; this runs its first 60 steps with the
same config and checks the loss has come down from ln(4096) ≈ 8.3 to below 6.0.
"""

from __future__ import annotations

from mlm.config import load_config
from mlm.data.build import BuildOptions, build_dataset
from mlm.data.corpus import write_stdlib_corpus
from mlm.data.tokenizer_train import TokenizerTrainOptions, train_tokenizer
from mlm.train.trainer import Trainer
from tests.helpers.common import ROOT

PIPELINE = ROOT / "pipelines" / "tiny" / "train.toml"


def test_tiny_pipeline_loss_falls(tmp_path):
    corpus = write_stdlib_corpus(tmp_path / "corpus.jsonl")
    train_tokenizer(TokenizerTrainOptions([corpus.path], str(tmp_path / "tok.model"), 4096, progress=False))
    build_dataset(
        BuildOptions(
            [corpus.path],
            str(tmp_path / "stdlib"),
            str(tmp_path / "tok.model"),
            append_eod=True,
            progress=False,
        )
    )
    cfg = load_config(
        PIPELINE,
        [
            f"data.data_path=['{tmp_path / 'stdlib'}']",
            f"run_dir='{tmp_path / 'run'}'",
            "checkpoint.save=''",
            "train.train_iters=60",
            "train.eval_interval=0",
            "logging.tensorboard=false",
            "logging.sample_prompt=''",
        ],
    )
    losses = Trainer(cfg).train()
    assert losses[0] > 8.0, losses[:3]
    assert sum(losses[-10:]) / 10 < 6.0, losses[-10:]
