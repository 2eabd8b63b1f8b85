"""pipelines/sft/run.sh as a user runs it: import a Hugging Face model, fine-tune it for 100 steps
on conversations (loss over the assistant's tokens), export it, and ask transformers a question
in the chat format. About 75 s on 2 cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.common import ROOT


def test_sft_recipe_fine_tunes_an_imported_model_that_answers_in_the_chat_format(tmp_path):
    pytest.importorskip("transformers")
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
        "OUT": str(tmp_path),
        "COLUMNS": "200",
        "HOME": os.environ.get("HOME", str(tmp_path)),
    }
    r = subprocess.run(
        ["bash", "pipelines/sft/run.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in records if "loss" in x and x.get("split", "train") == "train"]
    assert len(losses) >= 10
    assert losses[0] > 3.0 and losses[-1] < 0.5 * losses[0], losses  # the assistant-token loss falls
    # the exported model, loaded by transformers, answers after the template's generation prompt
    # and closes its turn with the template's end-of-turn token
    prompt = "<|im_start|>user\nWhat is the capital of Peru?<|im_end|>\n<|im_start|>assistant\n"
    assert prompt in r.stdout
    reply = r.stdout.split(prompt, 1)[1].strip()
    assert reply.startswith("The capital of") and reply.endswith("<|im_end|>"), reply
