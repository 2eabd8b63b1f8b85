"""Helpers the test files share (none of them imports another test file's helpers).

`mlm(...)` runs the CLI in a new process, as a user would; `cli(monkeypatch, capsys, ...)` runs
it in this one (no torch import per call) and returns the same CompletedProcess; `assert_error`
checks the one-message, exit-code-2 form of bad input; `checkpoint_logits` computes an mlm
checkpoint's logits and `checkpoint_weights` reads its tensors back whole; `chat_tokenizer` and `write_chat_config` make a Hugging Face tokenizer folder
with a chat template; `preset_rows` reads `mlm config list`'s table; `engine_checking_logits`
makes a serving engine that checks each step's logits against the training forward;
`saved_storages` collects what autograd saves for backward; `tiny_sets` is the --set list of the tiny
Llama training run most tests start from, and `write_jsonl` writes a corpus file.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root: every path a test reads or runs is under it."""

CHAT_SPECIAL_TOKENS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
"""The special tokens of the chat templates the tests use (ChatML's, Llama 3's)."""

CHATML_MARKED = (  # ChatML with the assistant's text marked
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def mlm(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        env={"PYTHONPATH": str(ROOT), "COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )


def preset_rows() -> dict[str, str]:
    """`mlm config list`'s table rows on stdout, by preset name (a file's console: every column whole)."""
    import contextlib
    import io

    from cli.config import list_presets

    with contextlib.redirect_stdout(io.StringIO()) as out:
        list_presets()
    return {line.split("│")[1].strip(): line for line in out.getvalue().splitlines() if line.count("│") > 3}


def cli(monkeypatch, capsys, *args) -> subprocess.CompletedProcess:
    """`mlm *args` in this process (no torch import per call), as `mlm()` returns it."""
    from cli.main import main

    monkeypatch.setattr(sys, "argv", ["mlm", *map(str, args)])
    monkeypatch.setenv("COLUMNS", "200")
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def assert_error(r, *fragments):
    assert r.returncode == 2, r.stdout + r.stderr
    err = " ".join(r.stderr.split())  # unwrap the console's line breaks
    assert "error:" in err and "Traceback" not in err, err
    for f in fragments:
        assert f in err, err


def checkpoint_logits(ckpt, tokens):
    """The logits (every padded vocabulary row) of the mlm checkpoint `ckpt`'s model on `tokens`."""
    import torch

    from mlm.checkpoint import read_group
    from mlm.config import config_from_dict
    from mlm.model.gpt import GPT

    state, manifest, _ = read_group(ckpt)
    cfg = config_from_dict(manifest["config"]).model
    with torch.device("meta"):
        model = GPT(cfg, state["embed.weight"].shape[0])
    model.load_state_dict(state, strict=True, assign=True)
    with torch.no_grad():
        return model.eval()(tokens)


def chat_tokenizer(folder: Path, texts: list[str]) -> Path:
    """`folder` with a byte-level BPE tokenizer.json trained on `texts`, plus `CHAT_SPECIAL_TOKENS`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=700, initial_alphabet=alphabet))
    tok.add_special_tokens([AddedToken(t, special=True) for t in CHAT_SPECIAL_TOKENS])
    tok.save(str(folder / "tokenizer.json"))
    return folder


def write_chat_config(folder: Path, template: str) -> None:
    """A tokenizer_config.json in `folder` with chat template `template`, as transformers reads it."""
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>", "chat_template": template}
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def checkpoint_weights(ckpt_dir, like: dict) -> dict:
    """The model tensors of checkpoint `ckpt_dir` in their global shapes, one like each of `like`."""
    import torch

    from mlm.checkpoint import ShardedTensor, load_checkpoint

    out = {k: torch.empty_like(v) for k, v in like.items()}
    load_checkpoint(ckpt_dir, {"model": [ShardedTensor.full(k, v) for k, v in out.items()]})
    return out


def engine_checking_logits(model, config):
    """An engine whose every step's logits are compared with the training forward's over each
    sampling sequence's tokens so far (fp32, 1e-5); a segment is matched to its sequence by its
    cache blocks (every model has them; only recurrent ones have state slots)."""
    import torch

    from mlm.inference.engine import Engine

    engine = Engine(model, config=config)
    forward = engine.runner.forward
    checked = []

    def checking(segments):
        logits_BV = forward(segments)
        rows = [c for c in segments if c.sample]
        for c, row in zip(rows, logits_BV, strict=True):
            seq = next(s for s in engine.scheduler.running if s.blocks is c.blocks or s.blocks == c.blocks)
            tokens = seq.tokens(0, c.start + len(c.tokens))
            with torch.no_grad():
                want = model(torch.tensor([tokens]))[0, -1, : row.shape[0]]
            torch.testing.assert_close(row, want, rtol=1e-5, atol=1e-5)
            checked.append(len(tokens))
        return logits_BV

    engine.runner.forward = checking
    return engine, checked


@contextlib.contextmanager
def saved_storages(model):
    """Inside: {storage pointer: bytes} of each distinct storage autograd saves for backward that
    is not one of `model`'s parameters (what a forward run inside keeps for its backward)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if (ptr := t.untyped_storage().data_ptr()) not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t}) + "\n")
    return path


def tiny_sets(run_dir, data, **extra) -> list[str]:
    sets = {
        "preset": "tiny-llama",
        "run_dir": f"'{run_dir}'",
        "model.vocab_size": 512,
        "model.num_layers": 2,
        "model.hidden_size": 64,
        "model.ffn_hidden_size": 128,
        "model.max_position_embeddings": 64,
        "model.hidden_dropout": 0.1,  # so that a resume must restore the RNG too
        "data.data_path": f"['{data}']",
        "data.seq_length": 32,
        "data.split": "'90,10,0'",
        "optimizer.lr": 1e-2,
        "optimizer.warmup_iters": 2,
        "train.micro_batch_size": 2,
        "train.global_batch_size": 4,
        "train.train_iters": 6,
        "logging.log_interval": 1,
        "logging.tensorboard": "false",
        **extra,
    }
    return [f"{k}={v}" for k, v in sets.items()]
