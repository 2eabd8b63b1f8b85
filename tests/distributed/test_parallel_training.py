"""`mlm train` on a mesh equals one process: tp, tp + sequence parallel, dp, dp with the
distributed optimizer, tp × dp with the distributed optimizer (all with gradient accumulation);
pipelines: pp 2 (uneven stages), pp 4, pp 2 interleaved (vpp 2), pp 2 × tp 2 with sequence
parallelism, pp 2 × dp 2 with the distributed optimizer and tied embeddings, pp 2 × tp 2 × dp 2;
and sharded checkpoints that resume on the same mesh and load on another.

Every rank is a real gloo process (`run_ranks`). Tolerance: fp32, 1e-5 relative on losses and
on the final weights (read back through the checkpoint, in their global layout). Not bitwise:
reductions sum the same numbers in another order (dp all-reduce, tp partial sums).

Adam's eps is 1e-4 here, not 1e-8: with a tiny eps the update g / (|g| + eps) is ±lr for any
gradient element far above eps, so an element whose true gradient is ~0 takes an lr-sized step
in whichever direction its rounding error points (measured: 8e-3 differences after 5 steps at
lr 1e-2 with eps 1e-8, while losses agree to 1e-5). eps 1e-4 keeps the update a smooth
function of the gradient, and the weights then agree to ~2e-7.
"""

from __future__ import annotations

import json

import pytest
import torch

from mlm.config import load_config
from mlm.convert.hf.folder import export_hf
from mlm.tokenizer import load_tokenizer
from mlm.train.trainer import Trainer
from tests.helpers.distributed import run_ranks
from tests.helpers.parallel import RTOL, assert_matches, reference_run, run_sets, train_rank


@pytest.fixture(scope="module")
def references(tmp_path_factory, tiny_data):
    """`reference_run` for a model, computed once per module."""
    cache = {}

    def get(**model):
        key = tuple(sorted(model.items()))
        if key not in cache:
            cache[key] = reference_run(tmp_path_factory.mktemp("reference"), tiny_data, **model)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def reference(references):
    return references()


@pytest.mark.parametrize(
    "world,parallel",
    [
        (2, {"parallel.tp": 2}),
        (2, {"parallel.tp": 2, "parallel.sequence_parallel": "true"}),
        (2, {}),  # dp = 2
        (2, {"parallel.distributed_optimizer": "true", "parallel.bucket_size_mb": 0.05}),
        (4, {"parallel.tp": 2, "parallel.distributed_optimizer": "true", "parallel.bucket_size_mb": 0.05}),
    ],
    ids=["tp2", "tp2-sp", "dp2", "dp2-distopt", "tp2xdp2-distopt"],
)
def test_mesh_matches_one_process(tmp_path, tiny_data, reference, world, parallel):
    sets = run_sets(tmp_path, tiny_data, "mesh", **parallel)
    assert_matches(tmp_path, run_ranks(world, train_rank, sets), *reference)


FOUR_LAYERS = {"model.num_layers": 4}
PIPELINE_RUN = {"model.num_layers": 4, "train.train_iters": 3}
ONE_PROCESS = {"parallel.pp": 1, "parallel.tp": 1}
TIED = {**PIPELINE_RUN, "model.tie_embeddings": "true"}
# no biases: the key bias has a zero gradient up to rounding, which Adam turns into lr-sized steps
GPT2 = {
    **PIPELINE_RUN,
    "preset": "tiny-gpt2",
    "model.vocab_size": 512,
    "model.max_position_embeddings": 64,
    "model.add_bias": "false",
}
DISTOPT = {"parallel.distributed_optimizer": "true", "parallel.bucket_size_mb": 0.05}


@pytest.mark.parametrize(
    "world,model,parallel",
    [
        (2, PIPELINE_RUN, {"parallel.pp": 2, "parallel.first_stage_layers": 1}),
        (4, PIPELINE_RUN, {"parallel.pp": 4}),
        (2, PIPELINE_RUN, {"parallel.pp": 2, "parallel.vpp": 2}),
        (4, PIPELINE_RUN, {"parallel.pp": 2, "parallel.tp": 2, "parallel.sequence_parallel": "true"}),
        (4, TIED, {"parallel.pp": 2, **DISTOPT}),
        (8, TIED, {"parallel.pp": 2, "parallel.tp": 2, "parallel.vpp": 2, **DISTOPT}),
        (2, GPT2, {"parallel.pp": 2}),
    ],
    ids=[
        "pp2-uneven",
        "pp4",
        "pp2-vpp2",
        "pp2xtp2-sp",
        "pp2xdp2-distopt-tied",
        "pp2xtp2xdp2-vpp2-distopt-tied",
        "pp2-learned-positions",  # later stages must not rotate (they once applied RoPE)
    ],
)
def test_pipeline_matches_one_process(tmp_path, tiny_data, references, world, model, parallel):
    """Global batch 8 in micro-batches of 2: 4 micro-batches per step (2 at dp 2), 3 steps."""
    sets = run_sets(tmp_path, tiny_data, "mesh", **model, **parallel)
    assert_matches(tmp_path, run_ranks(world, train_rank, sets), *references(**model))


def _save_then_resume(rank, world, sets_a, sets_b, resume_from):
    straight = Trainer(load_config(None, sets_a)).train()
    resumed = Trainer(load_config(None, sets_b), load=resume_from).train()
    return straight, resumed


def test_tp2_dp2_checkpoint_resumes_exactly_and_loads_on_one_process(tmp_path, tiny_data):
    parallel = {
        "parallel.tp": 2,
        "parallel.distributed_optimizer": "true",
        "train.train_iters": 6,
        "checkpoint.save_interval": 3,
    }
    sets_a = run_sets(tmp_path, tiny_data, "a", **parallel, **{"checkpoint.async_save": "true"})
    sets_b = run_sets(tmp_path, tiny_data, "b", **parallel)
    ckpt = tmp_path / "a" / "ckpt" / "iter_0000003"
    straight, resumed = run_ranks(4, _save_then_resume, sets_a, sets_b, str(ckpt))[0]
    assert resumed == straight[3:]  # same mesh: bitwise
    # the same checkpoint in one process (another mesh): the continuation agrees within fp32 tolerance
    one = Trainer(
        load_config(None, run_sets(tmp_path, tiny_data, "c", **{"train.train_iters": 6})), load=str(ckpt)
    )
    torch.testing.assert_close(torch.tensor(one.train()), torch.tensor(straight[3:]), rtol=RTOL, atol=0)


def _resume_and_logits(rank, world, sets_a, sets_b, resume_from, tokens):
    straight = Trainer(load_config(None, sets_a)).train()
    trainer = Trainer(load_config(None, sets_b), load=resume_from)
    # the checkpoint's logits, validation loss and greedy sample, on every rank
    seen = trainer.pipeline.logits(tokens), trainer.evaluate(), trainer.sample()
    return straight, trainer.train(), seen


def test_pp2_tp2_checkpoint_resumes_exactly_and_gives_the_same_logits_at_pp1(tmp_path, tiny_data, sp_model):
    parallel = {
        **FOUR_LAYERS,
        "model.make_vocab_size_divisible_by": 200,  # 512 rows pad to 800 at tp 2, to 600 at tp 1
        "model.hidden_dropout": 0.1,  # each stage's dropout RNG must be restored, not rank 0's
        "parallel.pp": 2,
        "parallel.tp": 2,
        "train.train_iters": 6,
        "checkpoint.save_interval": 3,
        "train.eval_interval": 100,  # builds the validation split; evaluates at the end
        "logging.sample_prompt": "'def '",
        "logging.sample_tokens": 8,
    }
    sets_a = run_sets(tmp_path, tiny_data, "a", **parallel)
    sets_b = run_sets(tmp_path, tiny_data, "b", **parallel)
    ckpt = tmp_path / "a" / "ckpt" / "iter_0000003"
    tokens = torch.arange(40).view(2, 20) * 7 % 500
    got = run_ranks(4, _resume_and_logits, sets_a, sets_b, str(ckpt), tokens)
    straight, resumed, (logits, eval_loss, sample) = got[0]
    assert resumed == straight[3:]  # same mesh: bitwise, dropout included
    assert all(r[2][2] == sample for r in got)  # every rank gets the same sample
    # the layer-numbered global checkpoint in one process (pp 1, tp 1): the same logits
    one = Trainer(
        load_config(None, run_sets(tmp_path, tiny_data, "c", **{**parallel, **ONE_PROCESS})), load=str(ckpt)
    )
    vocab = 512  # the logits of padding rows (600 at tp 1, 800 at tp 2) are zeros
    torch.testing.assert_close(
        one.pipeline.logits(tokens)[..., :vocab], logits[..., :vocab], rtol=1e-5, atol=1e-5
    )
    assert one.evaluate() == pytest.approx(eval_loss, rel=RTOL)
    assert one.sample() == sample
    # exported to Hugging Face after those tp 2 training steps: transformers gives the same logits
    import transformers  # here, not at the top: every rank process imports this module

    report = export_hf(ckpt, tmp_path / "hf")
    # the SentencePiece model the run's dataset records travels as tokenizer.model, with its eos id
    assert report.tokenizer_files == ["tokenizer.model"]
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == sp_model.read_bytes()
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == load_tokenizer(sp_model).eod_id
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits
    torch.testing.assert_close(theirs, logits[..., :vocab], rtol=1e-5, atol=1e-5)
    # straight into a tp 1 × pp 2 run (another vocabulary padding, each stage's own RNG): it
    # continues as the saving mesh did
    sets_d = run_sets(tmp_path, tiny_data, "d", **{**parallel, "parallel.tp": 1})
    other = run_ranks(2, train_rank, sets_d, str(ckpt))[0]
    torch.testing.assert_close(torch.tensor(other), torch.tensor(straight[3:]), rtol=RTOL, atol=0)


def _evaluate(rank, world, sets):
    return Trainer(load_config(None, sets)).evaluate()


def test_eval_loss_is_the_same_at_dp1_dp2_tp2(tmp_path, tiny_data):
    """Evaluation covers `eval_iters` global batches whatever the mesh (Megatron's meaning), so the
    loss of the same weights (one process's init, on every mesh) agrees to 1e-6 in fp32 (the sum
    runs in another order). Covering eval_iters micro-batches per dp rank instead moves it ~2e-4."""
    evaluation = {"train.eval_interval": 1, "train.eval_iters": 3, "train.global_batch_size": 8}
    one = Trainer(load_config(None, run_sets(tmp_path, tiny_data, "one", **evaluation))).evaluate()
    dp2 = run_ranks(2, _evaluate, run_sets(tmp_path, tiny_data, "dp2", **evaluation))
    tp2 = run_ranks(2, _evaluate, run_sets(tmp_path, tiny_data, "tp2", **evaluation, **{"parallel.tp": 2}))
    for loss in dp2 + tp2:
        assert loss == pytest.approx(one, rel=1e-6, abs=0)
