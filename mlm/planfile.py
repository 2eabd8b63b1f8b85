"""The plan file: what `mlm plan` writes and `mlm train --plan` reads (TOML, versioned).

    format = "mlm-plan"
    version = 1
    [model]       preset, overrides (the `--set` items the plan was made with)
    [cluster]     gpus, gpus_per_node, hardware
    [mesh]        tp, pp, vpp, dp, cp, ep, sequence_parallel, first_stage_layers, last_stage_layers,
                  cp_comm_type (optional: plans from before context parallelism lack it)
    [batching]    micro_batch_size, global_batch_size, accumulation, seq_length
    [choices]     recompute, distributed_optimizer, precision
    [prediction]  step_time_s, tokens_per_s_per_gpu, mfu, and [prediction.memory_gb] by component

`train_overrides` turns a plan into `--set` items for `mlm.config.load_config`, so that a run
config plus a plan plus the user's own `--set` (applied last) make the run. The file is written
under a temporary name and renamed into place; a reader refuses a version it does not know.
"""

from __future__ import annotations

from pathlib import Path

from mlm.config import toml_value
from mlm.errors import MlmError, check_version
from mlm.fileio import atomic_write_text, read_toml

FORMAT = "mlm-plan"
VERSION = 1
READS = (1,)
SECTIONS = {
    "model": ("preset", "overrides"),
    "cluster": ("gpus", "gpus_per_node", "hardware"),
    "mesh": ("tp", "pp", "vpp", "dp", "cp", "ep", "sequence_parallel"),
    "batching": ("micro_batch_size", "global_batch_size", "accumulation", "seq_length"),
    "choices": ("recompute", "distributed_optimizer", "precision"),
}


def dumps(plan: dict) -> str:
    """A plan dict as TOML (tables of scalars and lists; one level of sub-tables)."""
    check(plan, "<plan>")
    lines = [f"format = {toml_value(FORMAT)}", f"version = {VERSION}"]

    def table(name: str, body: dict) -> None:
        lines.append("")
        lines.append(f"[{name}]")
        subs = []
        for k, v in body.items():
            if isinstance(v, dict):
                subs.append((k, v))
            elif v is not None:
                lines.append(f"{k} = {toml_value(v)}")
        for k, v in subs:
            table(f"{name}.{k}", v)

    for name, body in plan.items():
        if name not in ("format", "version"):
            table(name, body)
    return "\n".join(lines) + "\n"


def write_plan(path: str | Path, plan: dict) -> None:
    atomic_write_text(path, dumps(plan))


def check(plan: dict, where: str) -> None:
    """MlmError unless `plan` has every section and key a reader needs."""
    for section, keys in SECTIONS.items():
        body = plan.get(section)
        if not isinstance(body, dict):
            raise MlmError(f"{where}: the plan has no [{section}] table; make it again with `mlm plan -o`")
        missing = [k for k in keys if k not in body]
        if missing:
            raise MlmError(
                f"{where}: [{section}] lacks {', '.join(missing)}; make it again with `mlm plan -o`"
            )


def read_plan(path: str | Path) -> dict:
    """The plan in `path`; MlmError naming the file when it is not a plan this mlm reads."""
    p = Path(path)
    plan = read_toml(p, missing=f"plan file not found (make one with `mlm plan ... -o {p}`)")
    if plan.get("format") != FORMAT:
        raise MlmError(f"{p}: format={plan.get('format')!r}, not an mlm plan (format = {FORMAT!r})")
    check_version(p, plan.get("version"), READS, "plan version")
    check(plan, str(p))
    return plan


def train_overrides(plan: dict) -> list[str]:
    """The `--set` items that give a run the plan's model, mesh, batching and choices."""
    model, mesh, batch, choice = plan["model"], plan["mesh"], plan["batching"], plan["choices"]
    sets = [f"preset={model['preset']}"] if model["preset"] else []
    sets += [s for s in model["overrides"] if s.split("=", 1)[0].strip().startswith("model.")]
    sets += [
        f"parallel.{k}={toml_value(mesh[k])}" for k in ("tp", "pp", "vpp", "cp", "ep", "sequence_parallel")
    ]
    if "cp_comm_type" in mesh:
        sets.append(f"parallel.cp_comm_type={toml_value(mesh['cp_comm_type'])}")
    for k in ("first_stage_layers", "last_stage_layers"):
        sets.append(f"parallel.{k}={mesh[k] if mesh.get(k) is not None else 'none'}")
    sets += [
        f"train.micro_batch_size={batch['micro_batch_size']}",
        f"train.global_batch_size={batch['global_batch_size']}",
        f"data.seq_length={batch['seq_length']}",
        f"model.recompute={toml_value(choice['recompute'])}",  # quoted: a bare none would unset it
        f"parallel.distributed_optimizer={toml_value(choice['distributed_optimizer'])}",
        f"train.precision={toml_value(choice['precision'])}",
    ]
    if "param_dtype" in choice:  # plans written before train.param_dtype: fp32 parameters
        sets.append(f"train.param_dtype={toml_value(choice['param_dtype'])}")
    return sets


def world_size_note(plan: dict, world_size: int) -> str | None:
    """A warning when the run's world size differs from the plan's GPU count, else None."""
    gpus, mesh = plan["cluster"]["gpus"], plan["mesh"]
    if world_size == gpus:
        return None
    inner = mesh["tp"] * mesh["pp"] * mesh["cp"]
    dp = f"dp={world_size // inner}" if world_size % inner == 0 else "no whole dp (the run will stop)"
    ep = mesh.get("ep", 1)
    stage = world_size // mesh["pp"]  # the dp × cp × tp ranks ep folds over
    if world_size % inner == 0 and stage % ep:
        dp += f", but ep={ep} does not divide dp × cp × tp = {stage} (the run will stop)"
    keep = f"tp={mesh['tp']} pp={mesh['pp']} cp={mesh['cp']}" + (f" ep={ep}" if ep > 1 else "")
    return (
        f"the plan was made for {gpus} GPUs (dp={mesh['dp']}) but this run has {world_size} ranks: "
        f"keeping {keep}, {dp}; its memory and speed "
        "predictions do not apply"
    )
