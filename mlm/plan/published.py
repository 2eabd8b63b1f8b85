"""The time model on published training runs: each run's model, cluster, layout and software as
its source gives them, predicted and compared with the throughput the source measured.

    runs = load_runs("tests/data/published_throughput.toml")
    for run in runs["run"]:
        p = predict(run)   # Prediction(measured and predicted tokens/s per GPU, the Candidate)

A run is a TOML table (schema in tests/data/README.md): the model's shape, `seq_length`,
`global_batch`, `micro_batch`, `gpus`, `gpus_per_node`, `hardware` (a profile of `mlm.hardware`),
`profile` (a software profile of `mlm.plan.software`, with optional `[run.software_overrides]`;
`software` describes the source's software in words),
the layout (`tp`, `pp`, `vpp`, `dp`, `cp`, `ep`, `sequence_parallel`, `recompute`,
`distributed_optimizer`, `fsdp`: FSDP's shard degree, cp joining it, as the layout's fsdp or
hsdp<N>), `precision`, and what was measured: `tokens_per_s_per_gpu`, `step_s`,
`tflops_per_gpu` or `mfu` (the last two over the FLOPs per token the source counted,
`flops_count`: see `source_flops_per_token`). Values the source does not give are in the
`[run.assumed]` table, named as assumptions; `[run.hardware_overrides]` changes the hardware
profile's fields (a GPU no built-in profile describes). Torch-free.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path

from mlm.config import load_config
from mlm.errors import MlmError
from mlm.flops import logits_flops, part_flops
from mlm.hardware import PROFILES as HARDWARE
from mlm.hardware import profile_name
from mlm.layout import Layout
from mlm.plan.candidates import Candidate, evaluate
from mlm.plan.job import Job
from mlm.plan.search import check_layout, stage_split
from mlm.plan.software import PROFILES as SOFTWARE
from mlm.plan.software import software_from_dict

MEASURES = ("tokens_per_s_per_gpu", "step_s", "tflops_per_gpu", "mfu")
DISPATCHERS = {"alltoall": "alltoall", "allgather": "allgather", "deepep": "alltoall", "flex": "alltoall"}
"""Megatron's token dispatchers as the time model counts them: DeepEP (the flex dispatcher) moves
the same tokens as the all-to-all, in fused kernels."""
REQUIRED = ("tp", "pp", "micro_batch", "global_batch", "gpus_per_node", "profile")
"""What a run needs beyond its model to be predicted (published, or in `[run.assumed]`)."""


@dataclass
class Prediction:
    run: dict
    measured: float
    """Tokens/s per GPU as published (converted from the published measure)."""
    candidate: Candidate
    job: Job

    @property
    def predicted(self) -> float:
        return self.candidate.timing.tokens_per_s_per_gpu

    @property
    def ratio(self) -> float:
        """Predicted / measured throughput."""
        return self.predicted / self.measured


def load_runs(path: str | Path) -> dict:
    with open(path, "rb") as f:
        return tomllib.load(f)


def _model_sets(run: dict) -> list[str]:
    """`--set` items for the run's model: Megatron's GPT (learned positions, LayerNorm, GeLU, biases,
    dropout 0.1, tied embeddings) or Llama style (RoPE, RMSNorm, SwiGLU, none of those)."""
    gpt = run.get("position", "rope") == "learned"
    sets = {
        "num_layers": run["num_layers"],
        "hidden_size": run["hidden_size"],
        "num_attention_heads": run["num_attention_heads"],
        "num_query_groups": run.get("num_query_groups", run["num_attention_heads"]),
        "ffn_hidden_size": run.get("ffn_hidden_size", 4 * run["hidden_size"]),
        "vocab_size": run["vocab_size"],
        "max_position_embeddings": run["seq_length"],
        "normalization": run.get("norm", "layernorm" if gpt else "rmsnorm"),
        "position_embedding": "learned" if gpt else "rope",
        "activation": run.get("activation", "gelu" if gpt else "swiglu"),
        "add_bias": run.get("add_bias", gpt),
        "tie_embeddings": run.get("tie_embeddings", gpt),
        "hidden_dropout": run.get("hidden_dropout", 0.1 if gpt else 0.0),
        "attention_dropout": run.get("attention_dropout", 0.1 if gpt else 0.0),
    }
    for key in ("kv_channels", "qk_norm"):
        if key in run:
            sets[key] = run[key]
    out = [f"model.{k}={str(v).lower() if isinstance(v, bool) else repr(v)}" for k, v in sets.items()]
    out = [x.replace("'", '"') for x in out]
    if "num_experts" in run:
        out += [
            'model.mlp_kind="moe"',
            f"model.mlp_kind_freq={run.get('moe_layer_freq', 1)}",
            f"model.moe.num_experts={run['num_experts']}",
            f"model.moe.router_topk={run['topk']}",
            f"model.moe.ffn_hidden_size={run['expert_ffn_hidden_size']}",
            f'model.moe.token_dispatcher="{DISPATCHERS[run.get("token_dispatcher", "alltoall")]}"',
        ]
        if run.get("shared_expert_ffn_hidden_size"):
            out.append(f"model.moe.shared_expert_ffn_hidden_size={run['shared_expert_ffn_hidden_size']}")
    return out


def job_and_layout(run: dict) -> tuple[Job, Layout]:
    """The run as the planner's inputs; MlmError naming the run when mlm cannot express it."""
    rid = run.get("id", "?")
    try:
        run = {**run, **run.get("assumed", {})}
        precision = run.get("precision", "bf16")
        dtype = "bf16" if precision == "fp8" else precision
        sets = _model_sets(run) + [
            f"data.seq_length={run['seq_length']}",
            f"train.global_batch_size={run['global_batch']}",
            f"train.micro_batch_size={run['micro_batch']}",
            f'train.precision="{dtype}"',
            f'train.param_dtype="{dtype}"',
        ]
        if precision == "fp8":
            sets.append('train.fp8.format="hybrid"')
        cfg = load_config(None, sets)
        fields = dict(run.get("hardware_overrides", {}))
        base = HARDWARE[profile_name(fields.pop("base", run["hardware"]))]
        hw = dataclasses.replace(base, name=run["hardware"], **fields) if fields else base
        sw = SOFTWARE[run["profile"]]
        if "software_overrides" in run:
            sw = software_from_dict(
                {"base": run["profile"], **run["software_overrides"]}, f"published run {rid!r}"
            )
        tp, pp, cp, vpp = run["tp"], run["pp"], run.get("cp", 1), run.get("vpp", 1)
        dp = run.get("dp", run["gpus"] // (tp * pp * cp))
        first, last = stage_split(run["num_layers"], pp, vpp)
        layout = Layout(
            tp,
            pp,
            dp,
            run["micro_batch"],
            run["global_batch"],
            vpp,
            run.get("sequence_parallel", tp > 1),
            run.get("recompute", "none"),
            run.get("distributed_optimizer", False) and "fsdp" not in run,
            first,
            last,
            cp=cp,
            ep=run.get("ep", 1),
            # FSDP's shard degree (torchtitan's data_parallel_shard_degree, which its cp joins)
            fsdp="fsdp" in run and dp * cp > 1,
            fsdp_shard=run["fsdp"] * cp if "fsdp" in run and dp * cp > 1 else None,
        )
        job = Job(cfg, run["gpus"], run["gpus_per_node"], hw, sw)
        check_layout(job, layout)
    except (KeyError, TypeError, MlmError) as e:  # a missing key, an unknown override
        raise MlmError(f"published run {rid!r}: {e}") from None
    return job, layout


def measures(run: dict, job: Job) -> dict[str, float]:
    """Every measure the run publishes, as tokens/s per GPU, in `MEASURES` order (TFLOP/s and MFU
    over the source's FLOPs per token, `source_flops_per_token`)."""
    run = {**run, **run.get("assumed", {})}
    per_token = source_flops_per_token(job, run.get("flops_count", "megatron"))
    rates = {
        "tokens_per_s_per_gpu": lambda v: v,
        "step_s": lambda v: run["global_batch"] * run["seq_length"] / v / run["gpus"],
        "tflops_per_gpu": lambda v: v * 1e12 / per_token,
        "mfu": lambda v: v * job.hardware.peak(job.cfg.train.precision) / per_token,
    }
    return {k: rates[k](run[k]) for k in MEASURES if k in run}


def measured_tokens_per_s(run: dict, job: Job) -> float:
    """The run's published measure as tokens/s per GPU: the first of `MEASURES` it gives."""
    published = measures(run, job)
    if not published:
        raise MlmError(f"published run {run.get('id', '?')!r}: no measure; give one of {', '.join(MEASURES)}")
    return next(iter(published.values()))


def family(run: dict) -> str:
    """The kind of run, for accuracy by kind: `megatron dense`, `megatron moe`, `torchtitan`, or
    `torchtitan cp` (context parallelism)."""
    if run["profile"] == "torchtitan":
        return "torchtitan cp" if run.get("cp", 1) > 1 or run["seq_length"] > 8192 else "torchtitan"
    return "megatron moe" if "num_experts" in run else "megatron dense"


def missing(run: dict) -> list[str]:
    """The keys a run needs and has neither published nor assumed."""
    have = run.keys() | run.get("assumed", {}).keys()
    return [k for k in REQUIRED if k not in have]


def evaluable(run: dict) -> bool:
    """Whether the run can be predicted: not when it says why not (`not_evaluated`), or when a
    key its source does not publish (in `unknown`) has no assumed value (then its `profile` may
    be missing too: a run that cannot be laid out names no software); MlmError for a key missing
    by mistake, `profile` included when it is the only gap."""
    if "not_evaluated" in run:
        return False
    gaps = missing(run)
    unknown = set(gaps) & set(run.get("unknown", []))
    if set(gaps) - unknown - ({"profile"} if unknown else set()):
        raise MlmError(
            f"published run {run.get('id', '?')!r}: missing {gaps} (neither in `unknown` nor assumed)"
        )
    return not gaps


def source_flops_per_token(job: Job, count: str) -> float:
    """Training FLOPs per token as a source counted them: `megatron` (`mlm.flops`: every matmul,
    attention over the full sequence, 3 passes), `causal` (Megatron-LM since 2025: the attention
    core halved for the causal mask), `recompute` (Narayanan et al. 2021: the layers' forward once
    more for full recompute, 4 passes; the logits 3)."""
    m, seq = job.cfg.model, job.cfg.data.seq_length
    total = job.flops_per_token
    if count == "megatron":
        return total
    if count == "causal":
        specs = m.layer_specs()
        core = sum(part_flops(m, s, seq).core for s in specs + specs[-1:] * m.mtp_num_layers)
        return total - core / 2
    if count == "recompute":
        logits = logits_flops(m) * (1 + m.mtp_num_layers)
        return (total - logits) * 4 / 3 + logits
    raise MlmError(f"flops_count={count!r}: must be megatron, causal or recompute")


def predict(run: dict) -> Prediction:
    job, layout = job_and_layout(run)
    return Prediction(run, measured_tokens_per_s(run, job), evaluate(job, layout), job)
