"""A checkpoint from `mlm train` carries its tokenizer (issue 41, trap 7): `mlm generate CKPT`
works from another folder, without --tokenizer, after the tokenizer the data named is gone."""

from __future__ import annotations

import shutil

from mlm.config import load_config
from mlm.data.build import BuildOptions, build_dataset
from mlm.train.trainer import Trainer
from tests.helpers.common import cli, tiny_sets


def test_generate_from_another_folder_without_the_tokenizer(
    tmp_path, corpus_jsonl, sp_model, monkeypatch, capsys
):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "tok").mkdir(parents=True)
    elsewhere.mkdir()
    shutil.copy(sp_model, project / "tok" / "tok.model")
    monkeypatch.chdir(project)  # as the tiny pipeline does: the data name their tokenizer by a relative path
    build_dataset(
        BuildOptions([str(corpus_jsonl)], "data/corpus", "tok/tok.model", append_eod=True, progress=False)
    )
    sets = {"train.train_iters": 1, "checkpoint.save": "'ckpt'", "logging.sample_prompt": "''"}
    Trainer(load_config(None, tiny_sets("run", "data/corpus", **sets))).train()
    assert (project / "ckpt" / "tokenizer" / "tokenizer.model").is_file()
    shutil.rmtree(project / "tok")
    monkeypatch.chdir(elsewhere)
    r = cli(
        monkeypatch, capsys, "generate", project / "ckpt", "-p", "def", "--max-tokens", "4", "--seed", "1"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("def"), r.stdout
