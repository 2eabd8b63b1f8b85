"""The planner's FSDP model against the real thing: on real gloo ranks (`run_ranks`) a tiny model
trains one step under fsdp dp 4, HSDP 2 × 2 and tp 2 × fsdp dp 2, and every rank's local bytes of
parameters, of gradients (read just before the optimizer steps) and of Adam's state equal
`mlm.plan.memory.model_state_bytes` for that rank, to the byte; so do the unsharded fp32 gradients
FSDP2 keeps between micro-batches (`fsdp_transient_bytes`), read before the last micro-batch.

The MLP's width (134) splits unevenly over 4 shards, and its tp 2 slices (67) over 2, so the
torch.chunk rule (ceil(rows / S) rows per rank, the last shorter) is what is checked, not 1/S.
With bf16 parameters the shards stay fp32 (the main weights) and the gradients accumulate in fp32.
The search offers FSDP and HSDP where they are built, and its table shows each sharding's best."""

from __future__ import annotations

import pytest

from mlm.config import load_config
from mlm.layout import Layout
from mlm.plan.memory import fsdp_transient_bytes, model_state_bytes, rank_stage
from tests.helpers.common import tiny_sets
from tests.helpers.distributed import run_ranks

SETS = {
    "parallel.fsdp": "true",
    "model.ffn_hidden_size": 134,
    "model.hidden_dropout": 0.0,
    "train.global_batch_size": 16,  # two micro-batches or more per rank: FSDP accumulates
    "train.micro_batch_size": 2,
    "train.train_iters": 1,
}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _measure(rank, world, sets):
    """This rank's local bytes: parameters, gradients before the step, Adam's moments and step
    counts after it, and the unsharded gradients FSDP holds before the last micro-batch."""
    from mlm.parallel import fsdp
    from mlm.train.trainer import Trainer

    seen: dict[str, int] = {}
    last = fsdp.FSDPGrads.set_last_microbatch

    def before_last(self, is_last):
        if is_last and "accumulated" not in seen:
            groups = {id(g): g for m in self.model.modules() if (g := _group(m)) is not None}
            # the fp32 accumulator beside bf16 parameters; the unsharded parameter's own fp32 grad
            held = [_held_grad(p) for g in groups.values() for p in g.fsdp_params]
            seen["accumulated"] = _nbytes(t for t in held if t is not None)
        return last(self, is_last)

    fsdp.FSDPGrads.set_last_microbatch = before_last
    trainer = Trainer(load_config(None, sets))
    assert trainer.model.fsdp
    step = trainer.optimizer.step

    def spy(lr, weight_decay):
        seen["gradients"] = _nbytes(
            p.grad.to_local() for p in trainer.model.parameters() if p.grad is not None
        )
        step(lr, weight_decay)

    trainer.optimizer.step = spy
    trainer.train()
    model = trainer.model
    state = trainer.optimizer.adamw.state.values()
    return {
        "weights": _nbytes(fsdp.local(p) for p in model.parameters()),
        "gradients": seen["gradients"],
        "optimizer": _nbytes(fsdp.local(t) for s in state for t in s.values()),
        "accumulated": seen.get("accumulated", 0),
        "names": [(n, p.numel()) for n, p in model.named_parameters()],
    }


def _held_grad(p):
    if p.unsharded_accumulated_grad is not None:
        return p.unsharded_accumulated_grad
    unsharded = getattr(p, "_unsharded_param", None)
    return None if unsharded is None else unsharded.grad


def _group(module):
    state = getattr(module, "_get_fsdp_state", None)
    return state()._fsdp_param_group if state is not None else None


@pytest.mark.parametrize(
    "world,parallel,uneven",
    [
        (4, {}, True),
        (4, {"parallel.fsdp_shard_size": 2}, False),
        (4, {"parallel.tp": 2, "parallel.sequence_parallel": "true"}, True),
        (2, {"train.precision": '"bf16"', "train.param_dtype": '"bf16"'}, False),
    ],
    ids=["fsdp-dp4", "hsdp-2x2", "tp2-fsdp-dp2", "fsdp-dp2-bf16-params"],
)
def test_measured_model_state_equals_the_plan(tmp_path, tiny_data, world, parallel, uneven):
    sets = tiny_sets(tmp_path, tiny_data, **{**SETS, **parallel})
    measured = run_ranks(world, _measure, sets)
    cfg = load_config(None, sets)
    lo = Layout.from_config(cfg, world)
    assert lo.fsdp and lo.num_micro > 1
    stage = rank_stage(cfg, lo.tp, lo.pp, lo.vpp, 0)
    transient = fsdp_transient_bytes(cfg, lo, stage)
    for rank, got in enumerate(measured):
        assert got["names"] == [(p.name, p.numel) for p in stage.params]
        predicted = model_state_bytes(cfg, stage, lo, dp_rank=rank // lo.tp)
        for k in ("weights", "gradients", "optimizer"):
            assert got[k] == predicted[k], (rank, k, got[k], predicted[k])
        assert got["accumulated"] == transient["unsharded gradients (accumulating)"], rank
    # 134 rows over 4 shards (or 67 over 2, at tp 2): the first shard rank holds more than the last
    assert (measured[0]["weights"] > measured[-1]["weights"]) == uneven


def _job(preset: str, gpus: int, global_batch: int | None = None):
    from mlm.plan.hardware import load_hardware
    from mlm.plan.job import make_job

    return make_job(None, [f"preset={preset}"], gpus, 8, load_hardware("h100-80g"), None, global_batch)


def test_the_search_offers_fsdp_and_hsdp_and_the_table_shows_each_sharding():
    """llama3-8b on 64 H100s: at 512 sequences a step FSDP over tp 2 × dp 32 is the fastest, HSDP
    (over the 4 dp ranks of a node at tp 2) next; at the preset's 8 sequences tp 8 × dp 8 with zero1
    wins and the table still shows the best FSDP, HSDP and unsharded layouts with their ranks."""
    from mlm.plan.report import shown_ranks
    from mlm.plan.search import search, sharding_name

    big = search(_job("llama3-8b", 64, 512)).ranked
    assert [str(c.layout) for c in big[:2]] == ["tp2dp32spfsdpmb2rcnonegb512", "tp2dp32sphsdp4mb1rcnonegb512"]
    small = search(_job("llama3-8b", 64))
    shown = [sharding_name(small.ranked[i - 1].layout) for i in shown_ranks(small.ranked, 3)]
    assert shown[:3] == ["zero1"] * 3 and {"fsdp", "hsdp2", "none"} <= set(shown[3:])
    only = search(_job("llama3-8b", 64, 512), "fsdp").ranked
    assert only and all(c.layout.fsdp for c in only if c.layout.dp_cp > 1)  # one rank: nothing to shard


def test_fsdp_is_not_offered_where_it_is_not_built():
    """deepseek-v3 has MTP depths, which FSDP is not built with (`fsdp_refusals`): the search offers
    no FSDP layout, and `--layout ...fsdp` names the setting."""
    from mlm.errors import MlmError
    from mlm.plan.pinned import complete
    from mlm.plan.search import shardings

    job = _job("deepseek-v3", 256, 1024)
    assert shardings(job, 1, 2, 16, ("none", "zero1", "hsdp", "fsdp")) == [
        (False, False, None),
        (True, False, None),
    ]
    with pytest.raises(MlmError, match="FSDP is not built with model.mtp_num_layers=1 yet; drop fsdp"):
        complete(job, Layout.parse("tp8pp2ep8fsdp"))
