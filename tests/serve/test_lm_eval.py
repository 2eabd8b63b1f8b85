"""lm-evaluation-harness against `mlm serve`: a multiple-choice task defined here (no download) scored
by lm-eval's `local-completions` model on `mlm serve` (its remote tokenizer: /tokenizer_info and
/tokenize; loglikelihoods from echo + logprobs) and by lm-eval's own Hugging Face backend on the
same weights. Skipped where lm-eval is not installed (it is in `.[dev]`).

Tolerance: per-choice loglikelihoods within 1e-4 (sums of a few fp32 log-probs; measured 1.9e-6),
the same greedy flags and the same accuracy. About 15 s on 2 cores."""

from __future__ import annotations

import importlib.util
import json

import pytest

from mlm.inference.engine import EngineConfig
from mlm.serve.app import ServerState, create_app
from mlm.serve.server import ServerThread, load_into
from tests.helpers.inference import tiny_llama_checkpoint

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("lm_eval", "tenacity", "accelerate")),
    reason="lm-evaluation-harness with its api and hf extras is not installed (pip install -e '.[dev]')",
)

DOCS = [
    {"question": "def add(a, b):\n    return", "choices": [" a + b", " a - b", " None"], "answer": 0},
    {"question": "import", "choices": [" torch", " numpy as np", " os"], "answer": 2},
    {"question": "class Config:\n    ", "choices": ["def __init__(self):", "pass", "x = 1"], "answer": 1},
    {"question": "for i in", "choices": [" range(10):", " items:", " x"], "answer": 0},
]


def _task(folder) -> None:
    """The task `mlm_mc`: DOCS as a multiple-choice loglikelihood task, accuracy."""
    data = folder / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (folder / "mlm_mc.yaml").write_text(
        f"task: mlm_mc\ndataset_path: json\ndataset_kwargs:\n  data_files: {data}\ntest_split: train\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
    )


def _scores(model: str, model_args: str, tasks_dir) -> tuple[dict, list]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model=model, model_args=model_args, tasks=["mlm_mc"], device="cpu", log_samples=True,
        task_manager=TaskManager(include_path=str(tasks_dir)),
    )  # fmt: skip
    samples = sorted(out["samples"]["mlm_mc"], key=lambda s: s["doc_id"])
    return out["results"]["mlm_mc"], [[r[0] for r in s["resps"]] for s in samples]


def test_lm_eval_scores_mlm_serve_as_its_hf_backend(tmp_path, hf_tokenizer_json, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the task's data is a local file
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, ckpt = tiny_llama_checkpoint(tmp_path, hf_tokenizer_json)
    _task(tmp_path)
    state = ServerState("tiny")
    engine = load_into(state, str(ckpt), EngineConfig(max_seqs=4, max_tokens_per_step=256), device="cpu")
    try:
        with ServerThread(create_app(state)) as server:
            args = f"model=tiny,base_url={server.url}/v1/completions,num_concurrent=1,max_retries=1,"
            served, theirs = _scores("local-completions", args + "tokenizer_backend=remote", tmp_path)
    finally:
        engine.stop()
    hf, ours = _scores("hf", f"pretrained={tmp_path / 'hf'},dtype=float32", tmp_path)
    assert served["acc,none"] == hf["acc,none"]
    for a, b in zip(theirs, ours, strict=True):  # per document, per choice: (loglikelihood, is_greedy)
        assert [g for _, g in a] == [g for _, g in b]
        assert [float(x) for x, _ in a] == pytest.approx([float(x) for x, _ in b], abs=1e-4)
