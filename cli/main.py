"""`mlm`: the entry point. Each stage is a sub-app that appears once it works.

User errors (`MlmError`) print one message and exit with code 2. Library modules are imported
inside the commands, so `mlm --help` starts fast and never imports torch.
"""

from __future__ import annotations

import sys

import typer

import mlm
from cli.config import app as config_app
from cli.convert import app as convert_app
from cli.convert import old_form
from cli.data import app as data_app
from cli.export import app as export_app
from cli.parity import parity
from cli.plan import plan
from cli.serve import generate, serve
from cli.train import slurm, train
from mlm.errors import MlmError

app = typer.Typer(
    name="mlm",
    help="Train large transformer language models the Megatron-LM way, stage by stage.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    rich_markup_mode=None,
)
app.add_typer(data_app, name="data")
app.command("plan")(plan)
app.command("train")(train)
app.command("slurm")(slurm)
app.command("parity")(parity)
app.add_typer(config_app, name="config")
app.add_typer(convert_app, name="convert")
app.add_typer(export_app, name="export")
app.command("serve")(serve)
app.command("generate")(generate)


def _version(value: bool) -> None:
    if value:
        print(f"mlm {mlm.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """mlm: data → plan → train → convert → export → serve, passing artifacts on disk."""


def main() -> None:
    try:
        if message := old_form(sys.argv[1:]):
            raise MlmError(message)
        app()
    except MlmError as e:
        from mlm.console import console

        console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
