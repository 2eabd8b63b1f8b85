"""mlm trains like Megatron-LM, step for step: megatron-core 0.16.1's own GPTModel, DDP, Adam
(`get_megatron_optimizer`, its weight-decay groups), clipping and OptimizerParamScheduler
(tests/helpers/megatron_ref.py, `init_and_train`, on CPU) against `mlm train` from the
same initial weights (imported with `mlm convert from-megatron`) on the same batches (mlm's
sampler's, fed to both), with the run config `mlm config from-megatron` makes of the Megatron-LM
argument list. Skipped where megatron-core is not installed.

Tolerance: per-step |Δloss| / loss ≤ 1e-5 (measured 7.8e-8 with cosine, 1.2e-7 with WSD, over a
loss going 6.21 → 6.05 / 5.90), gradient norms within 1e-4 relative, and the learning rate equal
(relative 1e-12) at every step, for a cosine schedule with warm-up and weight decay 0.1, for WSD
with a cosine final decay, for the cosine run resumed in mlm from Megatron's checkpoint at step 3,
mid-warm-up, and for a GPT-2-like model whose 512-token vocabulary Megatron pads to 640 (measured
1.1e-7; 3.5e-2 without model.train_padded_vocab). About 11 s a case on 2 cores, 17 s with the resume."""

import argparse
import shlex

import pytest
import torch

from mlm.config import load_config
from mlm.convert.megatron.command_line import command_line_sets, parse
from mlm.convert.megatron.importer import import_megatron
from mlm.train.trainer import Trainer
from tests.helpers.distributed import run_ranks  # noqa: E402
from tests.helpers.megatron_helpers import SETS, megatron  # noqa: E402, F401 (the fixture)
from tests.helpers.megatron_ref import SEQ, init_and_train  # noqa: E402

TRAINING = """--attention-dropout 0.0 --hidden-dropout 0.0 --micro-batch-size 2 --global-batch-size 4
--train-iters 20 --lr 1e-3 --min-lr 1e-4 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8
--clip-grad 1.0 --split 100,0,0 --norm-epsilon 1e-5"""
SIZES = f"""--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2
--ffn-hidden-size 96 --seq-length {SEQ} --max-position-embeddings {SEQ} --vocab-size 512 {TRAINING}"""
LLAMA = """--normalization RMSNorm --swiglu --position-embedding-type rope --rotary-base 10000 --disable-bias-linear
--untie-embeddings-and-output-weights --make-vocab-size-divisible-by 128"""
GPT2 = "--make-vocab-size-divisible-by 640"  # Megatron's defaults: LayerNorm, GELU, biases, learned positions, tied
COSINE = "--lr-warmup-iters 5 --lr-decay-iters 20 --lr-decay-style cosine"
WSD = "--lr-warmup-iters 3 --lr-decay-iters 20 --lr-decay-style WSD --lr-wsd-decay-style cosine --lr-wsd-decay-iters 8"
CASES = {  # (arguments, Megatron's padded vocabulary, megatron_ref's GPT-2-like model)
    "cosine": (f"{SIZES} {LLAMA} {COSINE}", 512, False),
    "wsd": (f"{SIZES} {LLAMA} {WSD}", 512, False),
    "gpt2-padded-vocab": (f"{SIZES} {GPT2} {COSINE}", 640, True),  # 512 tokens, 128 padding rows
}


def _mlm_run(cfg, load, monkeypatch) -> list:
    """`mlm train` of `cfg` from the checkpoint `load`: per step (its micro-batches' tokens, the step's result)."""
    steps = []
    train_step = Trainer.train_step

    def recorded(self, batches):
        result = train_step(self, batches)
        steps.append(([self._batch(self.train_data, b).clone() for b in batches], result))
        return result

    monkeypatch.setattr(Trainer, "train_step", recorded)
    Trainer(cfg, load=str(load)).train()
    monkeypatch.setattr(Trainer, "train_step", train_step)
    return steps


def _assert_same(steps, theirs) -> None:
    ours = {k: [r[k] for _, r in steps] for k in ("loss", "lr", "grad_norm")}
    assert ours["lr"] == pytest.approx(theirs["lr"], rel=1e-12, abs=0)
    rel = [abs(a - b) / b for a, b in zip(ours["loss"], theirs["loss"], strict=True)]
    assert max(rel) <= 1e-5, rel
    assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.usefixtures("megatron")
@pytest.mark.parametrize("case", list(CASES))
def test_twenty_steps_as_megatron(tmp_path, tiny_data, monkeypatch, case):
    """From the same weights: the 20 steps of each side. For cosine, Megatron's run is also saved
    at step 3 (mid-warm-up) with its optimizer, imported with `mlm convert from-megatron`, and
    `mlm train` goes on from it: steps 4 to 20 as Megatron's."""
    text, padded, gpt2 = CASES[case]
    argv = shlex.split(text)
    run_ranks(1, init_and_train, str(tmp_path / "init"), padded, None, None, 0, gpt2)
    vocab = [
        "model.vocab_size=512",
        f"model.make_vocab_size_divisible_by={parse(argv)['make_vocab_size_divisible_by']}",
    ]
    import_megatron(tmp_path / "init", tmp_path / "ckpt", [*SETS, *vocab], weights_only=True)
    sets, _ = command_line_sets([*argv, "--data-path", tiny_data])
    run = [f"run_dir='{tmp_path / 'run'}'", "train.eval_interval=0", "logging.tensorboard=false"]
    cfg = load_config(None, [*sets, *run])
    o = cfg.optimizer
    assert (o.warmup_offset, o.weight_decay_exempt, cfg.model.train_padded_vocab) == (0, "1d", True)
    assert cfg.model.padded_vocab_size() == padded and (cfg.model.activation == "gelu") is gpt2
    steps = _mlm_run(cfg, tmp_path / "ckpt", monkeypatch)
    assert len(steps) == 20 and steps[0][0][0].shape == (2, SEQ + 1)
    args = argparse.Namespace(
        **{"lr_warmup_init": 0.0, "lr_wsd_decay_iters": 0, "lr_wsd_decay_style": None, **parse(argv)}
    )
    save_at = 3 if case == "cosine" else 0
    batches = [b for b, _ in steps]
    theirs = run_ranks(1, init_and_train, str(tmp_path / "init"), padded, batches, args, save_at, gpt2)[0]
    assert theirs["lr"][0] == 0.0  # Megatron's first step runs at lr_warmup_init
    _assert_same(steps, theirs)
    if not save_at:
        return
    import_megatron(tmp_path / "init-resumed", tmp_path / "resumed")
    data = [f"data.data_path=['{tiny_data}']", "data.split='100,0,0'", "train.seed=1234"]
    resumed = load_config(
        tmp_path / "resumed" / "config.toml", [*data, *run[1:], f"run_dir='{tmp_path / 'run2'}'"]
    )
    later = _mlm_run(resumed, tmp_path / "resumed", monkeypatch)
    assert len(later) == 20 - save_at and all(
        torch.equal(a, b)
        for (x, _), y in zip(later, batches[save_at:], strict=True)
        for a, b in zip(x, y, strict=True)
    )
    _assert_same(later, {k: v[save_at:] for k, v in theirs.items()})
