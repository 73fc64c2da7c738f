"""The `areno` command line (typer)."""

from __future__ import annotations

import typer

from areno import __version__

app = typer.Typer(
    name="areno",
    help="GRPO/GSPO post-training for language models on verifiable rewards.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def version() -> None:
    """Print the areno version."""
    typer.echo(__version__)


if __name__ == "__main__":
    app()
