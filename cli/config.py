"""`mlm config ...`: list presets, show a resolved config, translate a Megatron-LM command line."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(help="Model presets and resolved run configs.", no_args_is_help=True)


def _count_kinds(specs) -> str:
    """Each kind of layer and how many there are, in order of first use: "3 mla + dense, 58 mla + moe"
    (a hybrid's order is `mlm config show`'s)."""
    counts: dict[str, int] = {}
    for spec in specs:
        kinds = " + ".join(k for k in (spec.mixer, spec.mlp) if k is not None)
        counts[kinds] = counts.get(kinds, 0) + 1
    return ", ".join(f"{n} {kinds}" for kinds, n in counts.items())


@app.command("list")
def list_presets() -> None:
    """Presets with their parameter counts (MoE: total and active per token; MTP depths apart), layer
    kinds and sources; the table goes to stdout (`mlm config list | grep moe`)."""
    from rich.table import Table

    from mlm.config import load_config
    from mlm.console import human, make_console
    from mlm.model import flops_per_token, parameter_counts
    from mlm.presets import PRESETS

    table = Table(
        "preset",
        "parameters",
        "layers",
        "layer kinds",
        "hidden",
        "heads/groups",
        "seq",
        "train GFLOP/token",
        "source",
    )
    for name, (source, _, _) in PRESETS.items():
        cfg = load_config(overrides=[f"preset={name}"])
        m = cfg.model
        table.add_row(
            name,
            parameter_counts(m).describe(human),
            str(m.num_layers),
            _count_kinds(m.layer_specs()),
            str(m.hidden_size),
            f"{m.num_attention_heads}/{m.query_groups}",
            str(cfg.data.seq_length),
            f"{flops_per_token(m, cfg.data.seq_length) / 1e9:.2f}",
            source,
        )
    make_console(stderr=False).print(table)


@app.command("show")
def show(
    preset: str | None = typer.Argument(None, help="A preset name (see `mlm config list`)."),
    config: Path | None = typer.Option(None, "--config", "-c", help="A run config TOML file."),
    overrides: list[str] = typer.Option([], "--set", help="section.key=value (repeatable)."),
) -> None:
    """Print the resolved config as TOML, with the layers' kinds and pattern, parameter count and FLOPs per token."""
    from mlm.config import describe_layers, load_config, to_toml
    from mlm.model import flops_per_token, parameter_counts

    sets = ([f"preset={preset}"] if preset else []) + list(overrides)
    cfg = load_config(config, sets)
    counts = parameter_counts(cfg.model)
    n, active = counts.total, counts.active
    f = flops_per_token(cfg.model, cfg.data.seq_length)
    print(f"# layers: {describe_layers(cfg.model.layer_specs())}")
    print(f"# layer pattern: {cfg.model.pattern()}  (as model.layer_pattern; {_symbols()})")
    if active != n:  # MoE: a token uses k of the E routed experts
        print(
            f"# parameters: total {n:,} ({n / 1e9:.3f} B), active {active:,} ({active / 1e9:.3f} B) per token"
        )
    else:
        print(f"# parameters: {n:,} ({n / 1e9:.3f} B)")
    if counts.mtp:  # the MTP depths share the embedding and the output layer
        print(
            f"# MTP depths ({cfg.model.mtp_num_layers}): {counts.mtp:,} ({counts.mtp / 1e9:.3f} B) more, "
            f"{counts.mtp_active:,} active per token; {counts.built:,} in all"
        )
    print(f"# training FLOPs per token at seq {cfg.data.seq_length}: {f:.4g}")
    print(to_toml(cfg), end="")


@app.command("from-megatron", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def from_megatron(
    out: Path = typer.Argument(..., help="The mlm run config to write (TOML); must not exist."),
    argv: list[str] = typer.Argument(
        None, help="After --: pretrain_gpt.py's arguments, as in the SLURM script."
    ),
) -> None:
    """Write the mlm run config that trains what a Megatron-LM command line trains: model, schedule,
    precision, parallel layout and data; every argument mlm does not honour is named."""
    from mlm.config import load_config, to_toml
    from mlm.console import console
    from mlm.convert.megatron.command_line import command_line_sets
    from mlm.errors import MlmError
    from mlm.fileio import atomic_write_text
    from mlm.model import parameter_counts

    if out.exists():
        raise MlmError(f"{out} exists; choose a new file name (mlm config from-megatron does not overwrite)")
    if not argv:
        raise MlmError("mlm config from-megatron OUT.toml -- ARGS: pass pretrain_gpt.py's arguments after --")
    sets, notes = command_line_sets(argv)
    cfg = load_config(None, sets)
    atomic_write_text(out, to_toml(cfg))
    counts = parameter_counts(cfg.model)
    console.print(
        f"[bold green]wrote[/] {out}: {counts.total:,} parameters, {cfg.model.num_layers} layers, "
        f"{cfg.parallel.tp}-way tp, {cfg.parallel.pp}-way pp, {cfg.train.precision}",
        highlight=False,
        soft_wrap=True,
    )
    for note in notes:
        console.print(f"[bold yellow]note:[/] {note}", highlight=False, soft_wrap=True)


def _symbols() -> str:
    """The pattern symbols of the registered kinds: "* gqa, + mla, - dense, E moe"."""
    from mlm.model.kinds import symbols

    return ", ".join(f"{sym} {spec.name}" for sym, spec in symbols().items())
