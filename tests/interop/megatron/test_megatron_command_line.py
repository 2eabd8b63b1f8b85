"""`mlm config from-megatron OUT -- ARGS`: a Megatron-LM command line → an mlm run config.

The argument lists are those of Megatron-LM's examples/ (llama/train_llama3_8b_h100_fp8.sh,
mixtral/train_mixtral_8x7b_distributed.sh with the 8x7B sizes of its README, DeepSeek-V3's
published sizes in Megatron-LM's flags): the configs they give have the parameter counts of mlm's
presets, and what mlm does not honour is named, all of it in one message."""

import shlex

import pytest

from mlm.config import load_config
from mlm.convert.megatron.command_line import command_line_sets, moe_layer_freq, parse
from mlm.errors import MlmError
from mlm.model import parameter_counts
from mlm.train.schedule import lr_at
from tests.helpers.common import cli

MIXTRAL = """--use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768
--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --init-method-std 0.01
--attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8 --no-masked-softmax-fusion
--no-position-embedding --rotary-base 1000000 --num-experts 8 --moe-router-topk 2
--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm
--moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce --tokenizer-type Llama2Tokenizer
--tokenizer-model /data/tokenizer.model --data-path /data/text_document --split 99990,8,2 --micro-batch-size 1
--global-batch-size 256 --lr 1e-4 --train-iters 500000 --lr-decay-iters 320000 --lr-decay-style cosine
--min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 500 --clip-grad 1.0 --bf16 --tensor-model-parallel-size 1
--pipeline-model-parallel-size 4 --expert-model-parallel-size 8 --use-distributed-optimizer --sequence-parallel
--log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --no-load-optim --no-load-rng
--vocab-size 32000"""

DEEPSEEK_V3 = """--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 --kv-channels 128
--seq-length 4096 --max-position-embeddings 163840 --position-embedding-type rope --rotary-base 10000
--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
--vocab-size 129280 --make-vocab-size-divisible-by 1280 --multi-latent-attention --q-lora-rank 1536
--kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm
--rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 --num-experts 256 --moe-layer-freq ([0]*3+[1]*58)
--moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048 --moe-router-topk 8
--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-topk-scaling-factor 2.5
--moe-router-num-groups 8 --moe-router-group-topk 4 --moe-router-load-balancing-type seq_aux_loss
--moe-aux-loss-coeff 1e-4 --moe-token-dispatcher-type alltoall --mtp-num-layers 1 --micro-batch-size 1
--global-batch-size 8192 --lr 2.2e-4 --min-lr 2.2e-5 --train-iters 1000 --bf16 --init-method-std 0.006
--attention-dropout 0.0 --hidden-dropout 0.0 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 16
--expert-model-parallel-size 64 --sequence-parallel --use-distributed-optimizer"""

# Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh, its real-data branch, verbatim
LLAMA3_EXAMPLE = """--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
--group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 --max-position-embeddings 8192
--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0
--hidden-dropout 0.0 --swiglu --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
--untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1 --global-batch-size 128
--train-samples 1953125000 --lr-decay-samples 1949218748 --lr-warmup-samples 3906252 --lr 0.00015
--min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0
--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 --cross-entropy-loss-fusion
--calculate-per-token-loss --manual-gc --empty-unused-memory-level 1 --exit-duration-in-mins 235
--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather
--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel --use-distributed-optimizer
--overlap-grad-reduce --overlap-param-gather --data-path /data/text_document --tokenizer-type HuggingFaceTokenizer
--tokenizer-model /data/tokenizer --data-cache-path /cache --split '99,1,0'
--no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1 --vocab-size 128256
--log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput --profile
--profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60
--save /ckpt --load /ckpt --tensorboard-dir /tb"""

LLAMA3_8B = """--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention
--num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope
--rotary-base 500000 --use-rope-scaling --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights
--disable-bias-linear --vocab-size 128256 --micro-batch-size 1 --global-batch-size 128 --train-iters 1000
--lr 3e-4 --bf16"""


def _config(args: str):
    sets, notes = command_line_sets(shlex.split(args))
    return load_config(None, sets), notes


@pytest.mark.parametrize(
    "args, preset", [(MIXTRAL, "mixtral-8x7b"), (DEEPSEEK_V3, "deepseek-v3"), (LLAMA3_8B, "llama3-8b")]
)
def test_parameter_counts_equal_the_presets(args, preset):
    cfg, _ = _config(args)
    assert parameter_counts(cfg.model) == parameter_counts(load_config(None, [f"preset={preset}"]).model)


def test_what_is_carried():
    cfg, notes = _config(MIXTRAL)
    o, p, t = cfg.optimizer, cfg.parallel, cfg.train
    assert (o.lr, o.min_lr, o.warmup_iters, o.decay_iters, o.decay_style) == (
        1e-4,
        1e-5,
        500,
        320000,
        "cosine",
    )
    assert (o.warmup_offset, o.weight_decay_exempt, o.adam_beta2, o.weight_decay) == (0, "1d", 0.999, 0.1)
    assert (p.tp, p.pp, p.ep, p.sequence_parallel, p.distributed_optimizer) == (1, 4, 8, True, True)
    assert (t.precision, t.param_dtype, t.micro_batch_size, t.global_batch_size, t.train_iters) == (
        "bf16",
        "bf16",
        1,
        256,
        500000,
    )
    assert (cfg.data.data_path, cfg.data.split, cfg.data.seq_length) == (
        ["/data/text_document"],
        "99990,8,2",
        4096,
    )
    assert (cfg.model.hidden_dropout, cfg.model.init_std, cfg.model.moe.aux_loss_coeff) == (0.0, 0.01, 0.01)
    assert not notes
    # Megatron-LM's defaults where the command line says nothing: LayerNorm, learned positions, GELU, biases, ties
    bare, notes = _config("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --lr 1e-3 "
                          "--micro-batch-size 2 --train-iters 10")  # fmt: skip
    m = bare.model
    assert (m.normalization, m.position_embedding, m.activation, m.add_bias, m.tie_embeddings) == (
        "layernorm",
        "learned",
        "gelu",
        True,
        True,
    )
    assert (m.ffn_hidden_size, m.hidden_dropout, m.attention_dropout, bare.optimizer.decay_style) == (
        256,
        0.1,
        0.1,
        "linear",
    )
    assert "no --vocab-size" in " ".join(notes)


def test_unhonoured_arguments_named_in_one_message(tmp_path, monkeypatch, capsys):
    with pytest.raises(MlmError) as e:
        _config(LLAMA3_EXAMPLE)
    text = str(e.value)
    for arg in (
        "--apply-layernorm-1p (zero-centered norm weights",
        "--decoupled-lr 0.0005",
        "--decoupled-min-lr",
    ):
        assert arg in text, arg
    assert "3 argument(s) mlm does not honour" in text and "--bf16" not in text and "--fp8" not in text
    # a dense model without MTP: per-token averaging is mlm's (every token counts, equal micro-batches)
    assert "--calculate-per-token-loss" not in text
    honoured = LLAMA3_EXAMPLE.replace("--apply-layernorm-1p", "")
    cfg, notes = _config(honoured.replace("--decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5", ""))
    assert (
        "--calculate-per-token-loss: the same loss and gradients (up to rounding) as mlm's mean"
        in " ".join(notes)
    )
    with pytest.raises(
        MlmError, match=r"--calculate-per-token-loss with MoE or MTP layers \(Megatron then weighs"
    ):
        _config(f"{honoured} --num-experts 4 --moe-router-topk 2".replace("--decoupled-lr 5.0e-4", ""))
    fp8 = (cfg.train.fp8.format, cfg.train.fp8.amax_history_len, cfg.model.normalization)
    assert fp8 == ("hybrid", 1024, "layernorm")
    # Megatron's checkpoint folders are not mlm's: named in a note, not carried
    assert (cfg.checkpoint.save, cfg.checkpoint.load) == (
        type(cfg.checkpoint)().save,
        type(cfg.checkpoint)().load,
    )
    assert "--load /ckpt is Megatron-LM's checkpoint folder, not carried" in " ".join(notes)
    r = cli(
        monkeypatch,
        capsys,
        "config",
        "from-megatron",
        tmp_path / "run.toml",
        "--",
        *shlex.split(LLAMA3_EXAMPLE),
    )
    assert r.returncode == 2 and r.stderr.count("error:") == 1 and not (tmp_path / "run.toml").exists()
    r = cli(
        monkeypatch, capsys, "config", "from-megatron", tmp_path / "run.toml", "--", *shlex.split(LLAMA3_8B)
    )
    assert r.returncode == 0, r.stderr
    assert load_config(tmp_path / "run.toml").model.rope.scaling_type == "llama3"
    r = cli(
        monkeypatch, capsys, "config", "from-megatron", tmp_path / "run.toml", "--", *shlex.split(LLAMA3_8B)
    )
    assert r.returncode == 2 and "does not overwrite" in r.stderr


GPT3_SCHEDULE = """--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1
--global-batch-size 1536 --train-samples 146484375 --lr-decay-samples 126953125 --lr-warmup-samples 183105
--lr 6.0e-5 --min-lr 6.0e-6 --lr-decay-style cosine"""
"""The sample counts of Megatron-LM's GPT-3 175B example (examples/gpt3/train_gpt3_175b_distributed.sh)."""


def test_sample_counts_that_are_not_whole_global_batches():
    """Megatron's scheduler counts samples, so a warm-up of 183105 samples is 119.2 steps of 1536:
    carried in samples; its train length is whole steps, as Megatron-LM's update_train_iters floors it."""
    sets, notes = command_line_sets(GPT3_SCHEDULE.split())
    cfg = load_config(None, sets)
    o = cfg.optimizer
    assert (o.warmup_samples, o.decay_samples, o.warmup_iters, o.decay_iters) == (183105, 126953125, 0, None)
    assert cfg.train.train_iters == 146484375 // 1536 == 95367
    assert (
        "args.train_samples=146484375 is not a whole number of global batches (1536): 95367 steps" in notes[0]
    )
    # the learning rate of step s is Megatron's after s increments of 1536 samples
    assert lr_at(119, o, 95367, 1536) == pytest.approx(6e-5 * 119 * 1536 / 183105, rel=1e-12)
    assert (
        lr_at(120, o, 95367, 1536) < 6e-5 and lr_at(82652, o, 95367, 1536) == 6e-6
    )  # past the decay (82651.8 steps)
    with pytest.raises(MlmError, match="lacks --seq-length, which Megatron-LM has no default for; add it"):
        command_line_sets(GPT3_SCHEDULE.replace("--seq-length 32", "").split())


def test_parse_as_megatron_argparse():
    args = parse(["--split '99,1,0'", "--num-layers", "32", "--swiglu", "--no-rope-fusion", "--disable-bias-linear",
                  "--data-path", "0.3", "a", "0.7", "b", "--lr", "3e-4"])  # fmt: skip
    assert args == {"split": "99,1,0", "num_layers": 32, "swiglu": True, "rope_fusion": False,
                    "add_bias_linear": False, "data_path": [0.3, "a", 0.7, "b"], "lr": 3e-4}  # fmt: skip
    assert moe_layer_freq("([0]*3+[1]*58)", 61) == [0] * 3 + [1] * 58 and moe_layer_freq("[0,1]", 2) == [0, 1]
    with pytest.raises(MlmError, match="gives 3 layers, --num-layers 4"):
        moe_layer_freq("[0]*1+[1]*2", 4)
    with pytest.raises(MlmError, match=r"--moe-layer-freq __import__\('os'\)"):
        moe_layer_freq("__import__('os')", 4)  # never evaluated
