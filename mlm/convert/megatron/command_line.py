"""A Megatron-LM command line (pretrain_gpt.py's arguments, as a SLURM script passes them) → an mlm
run config: `mlm config from-megatron OUT.toml -- ARGS`.

    sets, notes = command_line_sets(["--num-layers", "32", "--hidden-size", "4096", ...])

The arguments are read as Megatron-LM's argparse reads them (`--flag value ...`, a flag alone is
true, `--no-X` sets X false), over Megatron-LM's defaults (`DEFAULTS`), then translated by the
one Megatron-args translation of `mlm.convert.megatron.args` (the model's fields as
`mlm convert from-megatron` reads a checkpoint's args, the schedule as `run_settings`) plus the
layer sizes, parallel layout, precision, data and run length that a command line says and a
checkpoint's shapes otherwise give. Every argument is either translated, known to leave the
trained model unchanged (`NO_EFFECT`: logging, kernels, overlap, I/O), or refused: all refused
ones are named in one MlmError. docs/megatron.md ("A Megatron-LM command line") lists them.
"""

from __future__ import annotations

import argparse
import re

from mlm.config import toml_value
from mlm.convert.megatron.args import READ, REFUSED_ARGS, args_overrides, run_settings
from mlm.errors import MlmError

DEFAULTS = {
    "normalization": "LayerNorm", "position_embedding_type": "learned_absolute", "swiglu": False,
    "add_bias_linear": True, "add_qkv_bias": False, "untie_embeddings_and_output_weights": False,
    "hidden_dropout": 0.1, "attention_dropout": 0.1, "init_method_std": 0.02, "norm_epsilon": 1e-5,
    "rotary_base": 10000, "make_vocab_size_divisible_by": 128, "qk_layernorm": False,
    "moe_router_topk": 2, "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.0,
    "moe_layer_freq": 1, "lr_decay_style": "linear", "weight_decay": 0.01, "adam_beta1": 0.9,
    "adam_beta2": 0.999, "adam_eps": 1e-8, "clip_grad": 1.0, "min_lr": 0.0, "seed": 1234,
    "split": "969, 30, 1",
}  # fmt: skip
"""Megatron-LM's defaults (megatron/training/arguments.py; megatron-core 0.16.1's TransformerConfig
and OptimizerConfig agree) for the arguments whose default differs from mlm's."""

_FLAGS = {
    "disable_bias_linear": ("add_bias_linear", False),
    "no_position_embedding": ("add_position_embedding", False),
    "use_rotary_position_embeddings": ("position_embedding_type", "rope"),
    "recompute_activations": ("recompute_granularity", "selective"),
}
"""Flags that set another argument (their argparse `dest` and value)."""

TRANSLATED = {
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
    "num_query_groups", "kv_channels", "seq_length", "max_position_embeddings", "vocab_size",
    "normalization", "position_embedding_type", "add_position_embedding", "swiglu", "add_bias_linear",
    "add_qkv_bias", "untie_embeddings_and_output_weights", "qk_layernorm", "num_experts",
    "moe_ffn_hidden_size", "moe_layer_freq", "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate", "moe_token_dispatcher_type", "tensor_model_parallel_size",
    "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers", "context_parallel_size", "cp_comm_type",
    "expert_model_parallel_size", "sequence_parallel", "use_distributed_optimizer", "bf16", "fp16",
    "initial_loss_scale", "loss_scale_window", "data_path", "split", "tokenizer_model", "seed",
    "reset_position_ids", "reset_attention_mask", "eval_interval", "eval_iters", "log_interval",
    "save_interval", "recompute_granularity", "multi_latent_attention",
    "weight_decay_incr_style", "start_weight_decay", "end_weight_decay", "lr_warmup_init", "fp8_format",
    "fp8_recipe", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo", "recompute_method",
    "recompute_num_layers", "calculate_per_token_loss",
}  # fmt: skip
"""Arguments translated here (`args.READ`: those `args_overrides` and `run_settings` translate)."""

REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
"""Arguments without a Megatron-LM default that every GPT run gives."""

NO_EFFECT = {
    "use_mcore_models", "transformer_impl", "attention_backend", "use_flash_attn", "masked_softmax_fusion",
    "bias_gelu_fusion", "bias_swiglu_fusion", "bias_dropout_fusion", "gradient_accumulation_fusion",
    "rope_fusion", "persist_layer_norm", "cross_entropy_loss_fusion", "moe_grouped_gemm",
    "moe_permute_fusion", "moe_router_fusion", "overlap_grad_reduce", "overlap_param_gather",
    "ddp_bucket_size", "ddp_average_in_collective", "async_tensor_model_parallel_allreduce",
    "tp_comm_overlap", "moe_shared_expert_overlap", "manual_gc", "manual_gc_interval",
    "empty_unused_memory_level", "exit_duration_in_mins", "exit_interval", "exit_signal_handler",
    "distributed_timeout_minutes", "distributed_backend", "num_workers", "data_cache_path",
    "mmap_bin_files", "create_attention_mask_in_dataloader", "log_throughput", "log_params_norm",
    "log_num_zeros_in_grad", "log_timers_to_tensorboard", "log_validation_ppl_to_tensorboard",
    "log_memory_to_tensorboard", "log_batch_size_to_tensorboard", "log_world_size_to_tensorboard",
    "log_loss_scale_to_tensorboard", "timing_log_level", "timing_log_option", "tensorboard_dir",
    "tensorboard_queue_size", "tensorboard_log_interval", "wandb_project", "wandb_exp_name",
    "wandb_save_dir", "profile", "profile_step_start", "profile_step_end", "profile_ranks",
    "use_pytorch_profiler", "ckpt_format", "async_save", "use_dist_ckpt", "load_optim", "load_rng",
    "save_optim", "save_rng", "finetune", "use_checkpoint_args", "auto_detect_ckpt_format",
    "dist_ckpt_strictness", "ckpt_fully_parallel_save", "ckpt_fully_parallel_load",
    "ckpt_assume_constant_structure", "tokenizer_type", "dataloader_type", "moe_use_legacy_grouped_gemm",
    "no_load_optim", "no_load_rng", "no_save_optim", "no_save_rng", "fp8_param_gather",
    "grad_reduce_in_bf16", "accumulate_allreduce_grads_in_fp32", "micro_batch_size_per_gpu",
}  # fmt: skip
"""Arguments that change how Megatron-LM runs (kernels, overlap, logging, files) but not what it
trains: read and set aside."""


def parse(argv: list[str]) -> dict:
    """{argparse dest: value} of a Megatron-LM command line: `--flag v` (several values: a list),
    a flag alone True, `--no-X` X False (`_FLAGS` for the flags that set another argument).
    Numbers become int or float; quotes a shell would have removed are stripped."""
    out, flag, values = {}, None, []

    def close() -> None:
        if flag is None:
            return
        dest = flag.replace("-", "_")
        if dest in _FLAGS:
            dest, value = _FLAGS[dest]
        elif not values:
            dest, value = (dest[3:], False) if dest.startswith("no_") else (dest, True)
        else:
            value = values[0] if len(values) == 1 else list(values)
        out[dest] = value

    for token in argv:
        for word in token.split() if token.startswith("--") and " " in token else [token]:
            if word.startswith("--"):
                close()
                flag, values = word[2:], []
            elif flag is None:
                raise MlmError(
                    f"Megatron-LM argument {word!r} comes before any --flag; pass the arguments of pretrain_gpt.py"
                )
            else:
                values.append(_number(word.strip("'\"")))
    close()
    return out


def _number(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def command_line_sets(argv: list[str]) -> tuple[list[str], list[str]]:
    """(--set strings of the mlm run config that trains what the Megatron-LM command line `argv`
    trains, notes). MlmError naming every argument mlm does not honour."""
    given = parse(argv)
    missing = [f"--{n.replace('_', '-')}" for n in REQUIRED if given.get(n) is None]
    if missing:
        one = len(missing) == 1
        raise MlmError(
            f"the Megatron-LM command line lacks {', '.join(missing)}, which Megatron-LM has no "
            f"default for; add {'it' if one else 'them'} as pretrain_gpt.py needs {'it' if one else 'them'}"
        )
    args = {**DEFAULTS, **given}
    known = TRANSLATED | NO_EFFECT | READ | set(DEFAULTS) | {"save", "load"}
    refused = [
        f"--{n.replace('_', '-')} ({REFUSED_ARGS[n]})" for n in given if n in REFUSED_ARGS and given[n]
    ]
    refused += [f"--{n.replace('_', '-')}" for n in given if n not in known and n not in REFUSED_ARGS]
    refused += _unsupported(args)
    if refused:
        raise MlmError(
            f"the Megatron-LM command line has {len(refused)} argument(s) mlm does not honour: {'; '.join(refused)}. "
            "Remove them (or change the run) and run mlm config from-megatron again"
        )
    sets = args_overrides({"args": argparse.Namespace(**args)})
    sets += [f"model.{k}={toml_value(v)}" for k, v in _structure(args).items()]
    settings, notes = run_settings(args)
    sets += [f"{k}={toml_value(v)}" for k, v in {**settings, **_run(args)}.items()]
    for name in ("save", "load"):  # Megatron's checkpoint folders: mlm writes and reads its own format
        if given.get(name):
            notes.append(
                f"--{name} {given[name]} is Megatron-LM's checkpoint folder, not carried: set checkpoint.{name} to a "
                f"folder of mlm's own{'; import a Megatron checkpoint with mlm convert from-megatron' if name == 'load' else ''}"
            )
    if given.get("calculate_per_token_loss") and not refused:
        notes.append(
            "--calculate-per-token-loss: the same loss and gradients (up to rounding) as mlm's mean over the global batch, as "
            "every token counts and every micro-batch holds the same number of tokens"
        )
    if "vocab_size" not in given:
        notes.append(
            "no --vocab-size: model.vocab_size is mlm's default; set it to the tokenizer's vocabulary"
        )
    return sets, notes


_FREQ = re.compile(r"\(?\s*(\[\s*[01]\s*\]\s*\*\s*\d+\s*\+?\s*)+\)?")


def moe_layer_freq(value, layers: int) -> int | list[int]:
    """Megatron-LM's --moe-layer-freq: an int (every N-th layer is MoE), or the Python list
    expression it evaluates, e.g. '([0]*3+[1]*58)': read here without evaluating it. MlmError
    for anything else, or a list whose length is not the layer count."""
    if isinstance(value, int):
        return value
    text = str(value).strip("'\"")
    if _FREQ.fullmatch(text):
        out = [
            int(bit) for bit, n in re.findall(r"\[\s*([01])\s*\]\s*\*\s*(\d+)", text) for _ in range(int(n))
        ]
    elif re.fullmatch(r"\[\s*[01](\s*,\s*[01])*\s*\]", text):
        out = [int(bit) for bit in re.findall(r"[01]", text)]
    else:
        raise MlmError(
            f"--moe-layer-freq {value}: give an int, a list of 0/1 or a sum of [0]*N / [1]*N terms"
        )
    if len(out) != layers:
        raise MlmError(f"--moe-layer-freq {value} gives {len(out)} layers, --num-layers {layers}")
    return out


def _unsupported(args: dict) -> list[str]:
    """Arguments mlm knows but cannot honour at the values given."""
    out = []
    if args.get("add_position_embedding") is False and args["position_embedding_type"] == "learned_absolute":
        out.append(
            "--no-position-embedding without --position-embedding-type rope (mlm has no position-free model)"
        )
    bad = {
        "decoupled_lr": args.get("decoupled_lr") is not None,
        "decoupled_min_lr": args.get("decoupled_min_lr") is not None,
        "expert_tensor_parallel_size": args.get("expert_tensor_parallel_size") not in (None, 1),
        "mock_data": bool(args.get("mock_data")),
        "recompute_method": args.get("recompute_method") not in (None, "uniform"),
    }
    out += [
        f"--{n.replace('_', '-')}" + ("" if args[n] is True else f" {args[n]}") for n, b in bad.items() if b
    ]
    if args.get("calculate_per_token_loss") and (args.get("num_experts") or args.get("mtp_num_layers")):
        out.append(
            "--calculate-per-token-loss with MoE or MTP layers (Megatron then weighs their auxiliary losses by "
            "1 / the global batch's tokens rather than 1 / its micro-batches; mlm weighs them as without it)"
        )
    return out


def _structure(args: dict) -> dict:
    """model.* fields a checkpoint's shapes would give: layer sizes, biases, tying, MoE."""
    h, heads = args["hidden_size"], args["num_attention_heads"]
    ffn = args.get("ffn_hidden_size")
    if ffn is None:  # Megatron-LM's default: 4h, or 2/3 of it in multiples of 64 for SwiGLU
        ffn = int(4 * h * 2 / 3 / 64) * 64 if args["swiglu"] else 4 * h
    out = {
        "num_layers": args["num_layers"],
        "hidden_size": h,
        "ffn_hidden_size": ffn,
        "add_bias": bool(args["add_bias_linear"]),
        "qkv_bias": bool(args["add_bias_linear"] or args["add_qkv_bias"]),
        "qk_norm": bool(args["qk_layernorm"]) and not args.get("multi_latent_attention"),
        "tie_embeddings": not args["untie_embeddings_and_output_weights"],
        "num_query_groups": args.get("num_query_groups") or 1 if args.get("group_query_attention") else heads,
        "max_position_embeddings": args.get("max_position_embeddings") or args["seq_length"],
    }
    if not args.get("multi_latent_attention"):  # Megatron-LM's default head dim, as an import sets it
        out["kv_channels"] = args.get("kv_channels") or h // heads
    if args.get("num_experts"):
        moe = {"mlp_kind": "moe", "mlp_kind_freq": moe_layer_freq(args["moe_layer_freq"], args["num_layers"]),
               "moe.num_experts": args["num_experts"], "moe.ffn_hidden_size": args.get("moe_ffn_hidden_size") or ffn}  # fmt: skip
        if args.get("moe_shared_expert_intermediate_size"):
            moe["moe.shared_expert_ffn_hidden_size"] = args["moe_shared_expert_intermediate_size"]
            moe["moe.shared_expert_gate"] = bool(args.get("moe_shared_expert_gate"))
        if args.get("moe_token_dispatcher_type"):
            moe["moe.token_dispatcher"] = args["moe_token_dispatcher_type"]
        out |= moe
    return out


def _run(args: dict) -> dict:
    """The run's other settings: parallel layout, precision, data, intervals."""
    out = {
        "parallel.tp": args.get("tensor_model_parallel_size") or 1,
        "parallel.pp": args.get("pipeline_model_parallel_size") or 1,
        "parallel.cp": args.get("context_parallel_size") or 1,
        "parallel.ep": args.get("expert_model_parallel_size") or 1,
        "parallel.sequence_parallel": bool(args.get("sequence_parallel")),
        "parallel.distributed_optimizer": bool(args.get("use_distributed_optimizer")),
        "train.seed": args["seed"],
        "data.split": str(args["split"]).replace(" ", ""),
    }
    layers, pp = args["num_layers"], out["parallel.pp"]
    if args.get("virtual_pipeline_model_parallel_size"):
        out["parallel.vpp"] = args["virtual_pipeline_model_parallel_size"]
    elif args.get("num_layers_per_virtual_pipeline_stage"):
        out["parallel.vpp"] = layers // pp // args["num_layers_per_virtual_pipeline_stage"]
    for theirs, ours in (("decoder_first_pipeline_num_layers", "first_stage_layers"),
                         ("decoder_last_pipeline_num_layers", "last_stage_layers"),
                         ("cp_comm_type", "cp_comm_type")):  # fmt: skip
        if args.get(theirs) is not None:
            out[f"parallel.{ours}"] = args[theirs]
    for kind in ("bf16", "fp16"):
        if args.get(kind):
            out |= {"train.precision": kind, "train.param_dtype": kind}
    for theirs, ours in (("initial_loss_scale", "train.initial_loss_scale"), ("loss_scale_window", "train.loss_scale_window"),
                         ("eval_interval", "train.eval_interval"), ("eval_iters", "train.eval_iters"),
                         ("log_interval", "logging.log_interval"), ("save_interval", "checkpoint.save_interval"),
                         ("tokenizer_model", "data.tokenizer"), ("reset_position_ids", "data.reset_position_ids"),
                         ("reset_attention_mask", "data.reset_attention_mask"), ("fp8_format", "train.fp8.format"),
                         ("fp8_recipe", "train.fp8.recipe"), ("fp8_margin", "train.fp8.margin"),
                         ("fp8_amax_history_len", "train.fp8.amax_history_len"),
                         ("fp8_amax_compute_algo", "train.fp8.amax_compute_algo")):  # fmt: skip
        if args.get(theirs) is not None:
            out[ours] = args[theirs]
    if args.get("data_path") is not None:
        path = args["data_path"]
        out["data.data_path"] = [str(p) for p in (path if isinstance(path, list) else [path])]
    if args.get("recompute_granularity"):
        out["model.recompute"] = args["recompute_granularity"]
    return out
