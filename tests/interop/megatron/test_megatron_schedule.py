"""mlm's learning-rate and weight-decay schedules against megatron-core's own
`OptimizerParamScheduler` (skipped where megatron-core is not installed), and the weight-decay
groups against Megatron's rule.

Megatron counts its scheduler in samples: it is built with every length times the global batch
(`get_optimizer_param_scheduler`), stepped once at construction and then by one global batch after
each optimizer step. So optimizer step s runs at its value after s increments, which mlm's
`lr_at(s)` with `optimizer.warmup_offset=0` must equal (relative 1e-12: the same formula in samples
rather than iterations, rounding apart)."""

import importlib.util
import itertools

import pytest
import torch

from mlm.config import OptimizerConfig, load_config
from mlm.convert.megatron.args import scheduler_arguments
from mlm.model.gpt import GPT
from mlm.train.adamw import exempt, make_optimizer
from mlm.train.schedule import lr_at, weight_decay_at
from tests.helpers.distributed import run_ranks  # noqa: E402
from tests.helpers.megatron_ref import scheduler_values  # noqa: E402

TRAIN, GBS = 40, 4

STYLES = ("cosine", "linear", "constant", "inverse-square-root", "wsd")
WARMUPS = [{}, {"warmup_iters": 5}, {"warmup_iters": 5, "lr_warmup_init": 1e-4}, {"warmup_fraction": 0.13},
           {"warmup_samples": 10}]  # fmt: skip
DECAYS = [{}, {"decay_iters": 30}, {"decay_samples": 110}]  # samples: 2.5 and 27.5 steps of GBS
WSD = [
    {"wsd_decay_iters": 10, "wsd_decay_style": s} for s in ("linear", "cosine", "exponential", "minus_sqrt")
] + [{"wsd_decay_samples": 30, "wsd_decay_style": "cosine"}]
WEIGHT_DECAYS = [{}, {"weight_decay_incr_style": "linear", "start_weight_decay": 0.0, "end_weight_decay": 0.1},
                 {"weight_decay_incr_style": "cosine", "start_weight_decay": 0.01, "end_weight_decay": 0.2}]  # fmt: skip
CASES = [
    {"decay_style": style, **warmup, **decay, **wsd, **wd}
    for style, warmup, decay, wd in itertools.product(STYLES, WARMUPS, DECAYS, WEIGHT_DECAYS)
    for wsd in (WSD if style == "wsd" else [{}])
]


def _config(settings: dict) -> OptimizerConfig:
    return OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_offset=0, **settings)


@pytest.fixture(scope="module")
def megatrons():
    """Every case's (lr, weight decays) per step from megatron-core's scheduler, in one rank process
    (megatron-core is never imported into the test process: it registers torch.load globals)."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is not installed (pinned for Python 3.11: pip install -e '.[dev]')")
    arguments = [scheduler_arguments(_config(s), TRAIN, GBS) for s in CASES]
    return run_ranks(1, scheduler_values, arguments, TRAIN + 3, GBS)[0]  # past the decay's end too


@pytest.mark.parametrize(
    "case", range(len(CASES)), ids=lambda i: ",".join(f"{k}={v}" for k, v in CASES[i].items())
)
def test_schedules_equal_megatron_core(megatrons, case):
    cfg = _config(CASES[case])
    for step, (lr, wd, exempt_wd) in enumerate(megatrons[case]):
        assert lr_at(step, cfg, TRAIN, GBS) == pytest.approx(lr, rel=1e-12, abs=1e-15), step
        assert weight_decay_at(step, cfg, TRAIN) == pytest.approx(wd, rel=1e-12, abs=1e-15) and exempt_wd == 0


def test_mlm_warmup_is_one_step_ahead():
    """mlm's default (warmup_offset 1) is Megatron's warm-up one step ahead, so the first step
    trains; from the end of the warm-up on the two are the same."""
    ours = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_iters=4)
    theirs = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_iters=4, warmup_offset=0)
    assert [lr_at(s, ours, 20) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert [lr_at(s, theirs, 20) for s in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert all(lr_at(s, ours, 20) == lr_at(s, theirs, 20) for s in range(4, 22))


def test_weight_decay_groups():
    """`1d` is Megatron's rule (biases and 1-d parameters, norms included, are exempt: the
    embeddings and the output layer decay); mlm's default `1d_and_embeddings` also exempts the
    embeddings; `none` decays everything. Each group's wd_mult scales the step's weight decay."""
    model = GPT(load_config(None, ["preset=tiny-gpt2", "data.seq_length=8"]).model)
    params = dict(model.named_parameters())
    rule = {n for n, p in params.items() if len(p.shape) == 1 or n.endswith(".bias")}  # Megatron's
    assert {n for n, p in params.items() if exempt(n, p, "1d")} == rule
    assert {"embed.weight", "pos_embed.weight"} <= set(params) - rule
    assert {n for n, p in params.items() if exempt(n, p, "1d_and_embeddings")} == rule | {
        "embed.weight",
        "pos_embed.weight",
    }
    assert not any(exempt(n, p, "none") for n, p in params.items())
    opt = make_optimizer(model, OptimizerConfig(weight_decay_exempt="1d"), torch.device("cpu"))
    assert [(g["wd_mult"], len(g["params"])) for g in opt.param_groups] == [
        (1.0, len(params) - len(rule)),
        (0.0, len(rule)),
    ]
