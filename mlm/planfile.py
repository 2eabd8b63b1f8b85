"""The plan file: what `mlm plan` writes and `mlm train --plan` reads (TOML, versioned).

    format = "mlm-plan"
    version = 1
    [model]       preset, overrides (the `--set` items the plan was made with)
    [cluster]     gpus, gpus_per_node, hardware
    [mesh]        layout (the text `mlm plan --layout` reads, docs/layout.md; optional: older plans
                  lack it), tp, pp, vpp, dp, cp, ep, sequence_parallel, first_stage_layers,
                  last_stage_layers, cp_comm_type (optional: plans from before context parallelism lack it)
    [batching]    micro_batch_size, global_batch_size, accumulation, seq_length
    [choices]     recompute, distributed_optimizer, fsdp, fsdp_shard_size (optional: plans from
                  before FSDP lack them; unset: over all dp × cp ranks), precision
    [prediction]  step_time_s, tokens_per_s_per_gpu, mfu, and [prediction.memory_gb] by component

`layout` reads the plan's `mlm.layout.Layout` from these tables (refusing a `layout` text that
says otherwise); `train_overrides` turns a plan into `--set` items for `mlm.config.load_config`, so that a run
config plus a plan plus the user's own `--set` (applied last) make the run. The file is written
under a temporary name and renamed into place; a reader refuses a version it does not know.
"""

from __future__ import annotations

from pathlib import Path

from mlm.config import toml_value
from mlm.errors import MlmError, check_version
from mlm.fileio import atomic_write_text, read_toml
from mlm.layout import Layout

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


def layout(plan: dict) -> Layout:
    """The plan's layout; MlmError when its `layout` text and its tables disagree (an edited plan)."""
    mesh, batch, choice = plan["mesh"], plan["batching"], plan["choices"]
    lo = Layout(
        mesh["tp"],
        mesh["pp"],
        mesh["dp"],
        batch["micro_batch_size"],
        batch["global_batch_size"],
        mesh["vpp"],
        mesh["sequence_parallel"],
        choice["recompute"],
        choice["distributed_optimizer"],
        mesh.get("first_stage_layers"),
        mesh.get("last_stage_layers"),
        mesh["cp"],
        mesh.get("ep", 1),
        mesh.get("cp_comm_type"),  # None (the run config's) in plans from before context parallelism
        choice.get("fsdp", False),
        choice.get("fsdp_shard_size"),
    )
    if "layout" in mesh and Layout.parse(mesh["layout"]) != lo:
        raise MlmError(
            f"the plan's [mesh] layout = {mesh['layout']!r} disagrees with its tables ({lo}); "
            "make it again with `mlm plan -o`, or edit both"
        )
    return lo


def train_overrides(plan: dict) -> list[str]:
    """The `--set` items that give a run the plan's model, mesh, batching and choices."""
    model, batch, choice = plan["model"], plan["batching"], plan["choices"]
    sets = [f"preset={model['preset']}"] if model["preset"] else []
    sets += [s for s in model["overrides"] if s.split("=", 1)[0].strip().startswith("model.")]
    sets += layout(plan).overrides()
    sets += [f"data.seq_length={batch['seq_length']}", f"train.precision={toml_value(choice['precision'])}"]
    if "param_dtype" in choice:  # plans written before train.param_dtype: fp32 parameters
        sets.append(f"train.param_dtype={toml_value(choice['param_dtype'])}")
    return sets


def world_size_note(plan: dict, world_size: int) -> str | None:
    """A warning when the run's world size differs from the plan's GPU count, else None."""
    gpus, lo = plan["cluster"]["gpus"], layout(plan)
    if world_size == gpus:
        return None
    inner = lo.tp * lo.pp * lo.cp
    dp = f"dp={world_size // inner}" if world_size % inner == 0 else "no whole dp (the run will stop)"
    stage = world_size // lo.pp  # the dp × cp × tp ranks ep folds over
    if world_size % inner == 0 and stage % lo.ep:
        dp += f", but ep={lo.ep} does not divide dp × cp × tp = {stage} (the run will stop)"
    keep = f"tp={lo.tp} pp={lo.pp} cp={lo.cp}" + (f" ep={lo.ep}" if lo.ep > 1 else "")
    return (
        f"the plan was made for {gpus} GPUs (dp={lo.dp}) but this run has {world_size} ranks: "
        f"keeping {keep}, {dp}; its memory and speed "
        "predictions do not apply"
    )
