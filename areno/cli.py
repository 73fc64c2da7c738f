"""The `areno` command line (typer).

`areno train` gets one flag per `TrainConfig` field, built from the field's
type, help and group (config.py is the only place a knob is declared). Every
flag defaults to None meaning "not given", so `--config` YAML values survive
unless a flag overrides them. User mistakes (click usage errors and
`UserError`) print one line, exit 2, no traceback.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Optional

import typer

from areno import __version__
from areno.config import TrainConfig, field_type, flag_name
from areno.errors import UserError

app = typer.Typer(
    name="areno",
    help="GRPO/GSPO post-training for language models on verifiable rewards.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(__version__)
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", help="Print the areno version and exit.",
                                 is_eager=True, callback=_print_version),
) -> None:
    """GRPO/GSPO post-training for language models on verifiable rewards."""


@app.command()
def version() -> None:
    """Print the areno version."""
    typer.echo(__version__)


def _train_parameters() -> list[inspect.Parameter]:
    params = [
        inspect.Parameter(
            "config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str],
            default=typer.Option(None, "--config", help="YAML file of options (flags override it).",
                                 rich_help_panel="Config", show_default=False),
        )
    ]
    for f in TrainConfig.fields():
        base = field_type(f.name)
        flag = flag_name(f.name)
        decls = [f"{flag}/--no-{flag[2:]}"] if base is bool else [flag]
        if f.name == "no_save":
            decls = [flag]
        default = f.default
        shown = "" if default is None else f" [default: {default}]"
        params.append(inspect.Parameter(
            f.name, inspect.Parameter.KEYWORD_ONLY, annotation=Optional[base],
            default=typer.Option(None, *decls, help=f.metadata["help"] + shown,
                                 rich_help_panel=f.metadata["group"], show_default=False),
        ))
    return params


def train(**kwargs: Any) -> None:
    """Train a policy with GRPO/GSPO. With no --ckpt and no --dataset-path it runs the
    embedded demo: a tiny model learns one-digit addition on CPU in a few minutes."""
    config_path = kwargs.pop("config", None)
    cfg = TrainConfig.from_sources(config_path, kwargs)
    from areno.trainer import run_training  # heavy imports only after validation

    run_training(cfg)


train.__signature__ = inspect.Signature(_train_parameters())  # type: ignore[attr-defined]
app.command(context_settings={"max_content_width": 120})(train)


@app.command()
def plot(
    run_dir: str = typer.Argument(..., help="Run directory holding metrics.jsonl."),
    out: Optional[str] = typer.Option(None, "--out", help="PNG path (default RUN_DIR/metrics.png)."),
) -> None:
    """Plot reward, response length, KL/clip fraction and per-phase time over the steps."""
    from areno.plot import plot_run

    path, _ = plot_run(run_dir, out)
    typer.echo(str(path))


@app.command()
def check() -> None:
    """Report the environment: torch, CUDA/GPUs, vLLM build, flash-attn (OK / WARN / FAIL)."""
    from areno.envcheck import run_checks

    raise typer.Exit(run_checks())


def main(argv: list[str] | None = None) -> int:
    """Console entry point: one-line errors with exit code 2 for user mistakes."""
    try:
        # Without standalone mode click returns (not raises) a command's typer.Exit
        # code: `areno check` exits 1 on a FAIL line only if that code is passed on.
        rc = app(args=argv, standalone_mode=False)
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        print("areno: aborted", file=sys.stderr)
        return 130
    except typer.TyperException as e:  # usage errors: unknown flag, bad value
        msg = _click_message(e)
        if not msg:  # bare `areno`: help was printed
            return 0
        print(f"areno: error: {msg}", file=sys.stderr)
        return 2
    except UserError as e:
        print(f"areno: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("areno: interrupted", file=sys.stderr)
        return 130
    return rc if isinstance(rc, int) else 0


def _click_message(e: typer.TyperException) -> str:
    fmt = getattr(e, "format_message", None)
    msg = " ".join((fmt() if fmt else str(e)).split())
    param = getattr(e, "param", None)
    if param is not None and getattr(param, "opts", None):
        name = param.opts[0]
        if name not in msg:
            msg = f"{name}: {msg}"
    return msg


if __name__ == "__main__":
    sys.exit(main())
