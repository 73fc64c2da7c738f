"""The `areno` command line (typer): the app behind `areno.cli.main`.

`areno train` gets one flag per `TrainConfig` field, built from the field's
type, help and group (config.py is the only place a knob is declared). Every
flag defaults to None meaning "not given", so `--config` YAML values survive
unless a flag overrides them. User mistakes (click usage errors and
`UserError`) print one line, exit 2, no traceback.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import typing
from typing import Any, Literal, Optional

import typer
from rich.markup import escape

from areno import __version__
from areno.config.train import TrainConfig, field_type
from areno.data.tasks.arith import DEMO_PRESET
from areno.errors import UserError
from areno.config.fieldcheck import flag_name
from areno.procs.signals import release

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
            default=typer.Option(None, "--config", rich_help_panel="Config", show_default=False,
                                 help=escape("YAML file of options (flags override it). "
                                             "[default: none]"), metavar="FILE"),
        )
    ]
    for f in TrainConfig.fields():
        base = field_type(f.name)
        flag = flag_name(f.name)
        # A switch that is off by default gets no --no- form: a second column of long
        # negated names would leave too little width and rich would cut flag names.
        # One whose derived default may be on names a short off_flag instead.
        off = f.metadata.get("off_flag") or (f"--no-{flag[2:]}" if base is bool and f.default else None)
        decls = [f"{flag}/{off}"] if off else [flag]
        params.append(inspect.Parameter(
            f.name, inspect.Parameter.KEYWORD_ONLY, annotation=Optional[base],
            default=typer.Option(None, *decls, help=option_help(f), metavar=_metavar(base),
                                 rich_help_panel=f.metadata["group"], show_default=False),
        ))
    return params


def option_help(f: dataclasses.Field) -> str:
    """The --help text of a TrainConfig field: its help, its choices (unless the help
    names them all), its default and the demo's value where the demo changes it.
    Escaped: rich would take `[default: 16]` or `list[float]` for markup and drop it."""
    text = f.metadata["help"]
    choices = typing.get_args(field_type(f.name))
    if typing.get_origin(field_type(f.name)) is Literal and not all(c in text for c in choices):
        text += f" One of: {', '.join(choices)}."
    text += f" [default: {f.metadata['shown'] or _show(f.default)}"
    if f.name in DEMO_PRESET and DEMO_PRESET[f.name] != f.default:
        text += f"; demo: {_show(DEMO_PRESET[f.name])}"
    return escape(text + "]")


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return "unset" if value is None else str(value)


def _metavar(base: Any) -> str:
    """A short type word: choices are listed in the help, so the type column stays narrow
    and rich does not cut flag names to fit a long `<a|b|c>` beside them."""
    if base is bool:
        return ""
    if typing.get_origin(base) is Literal:
        return "CHOICE"
    return {int: "INT", float: "FLOAT"}.get(base, "TEXT")


def train(**kwargs: Any) -> None:
    """`areno train`: validate the options, then run the loop (help: TRAIN_HELP)."""
    config_path = kwargs.pop("config", None)
    cfg = TrainConfig.from_sources(config_path, kwargs)
    from areno.config.resume import given_options, resume_config
    from areno.runtime.early import prespawn

    cfg = resume_config(cfg, given_options(config_path, kwargs))
    early = prespawn(cfg)  # the ranks import torch and transformers while this process does
    try:
        from areno.trainer import run_training  # heavy imports only after validation

        run_training(cfg, early=early)
    finally:
        if early is not None:
            early.close()  # never adopted: a mistake found meanwhile (a no-op once adopted)


train.__signature__ = inspect.Signature(_train_parameters())  # type: ignore[attr-defined]
# One paragraph (rich keeps a docstring's line breaks).
TRAIN_HELP = (
    "Train a policy with GRPO/GSPO. With no --ckpt and no --dataset-path it runs the embedded "
    "demo: a tiny model learns one-digit addition on CPU in about a minute, with its own values "
    "for the options marked 'demo:' below (a flag or --config still overrides them)."
)
app.command(help=TRAIN_HELP, context_settings={"max_content_width": 120})(train)


@app.command()
def plot(
    run_dir: str = typer.Argument(..., help="Run directory holding metrics.jsonl."),
    out: Optional[str] = typer.Option(None, "--out", help="PNG path (default RUN_DIR/metrics.png)."),
) -> None:
    """Plot reward, response length, KL/clip fraction and per-phase time over the steps."""
    release()
    from areno.cli.plot import plot_run

    path, _ = plot_run(run_dir, out)
    typer.echo(str(path))


@app.command()
def check() -> None:
    """Report the environment: torch, CUDA/GPUs, vLLM build, flash-attn (OK / WARN / FAIL)."""
    release()
    from areno.cli.check import run_checks

    raise typer.Exit(run_checks())


def run_app(argv: list[str] | None = None) -> int:
    """The app, with one-line errors and exit code 2 for user mistakes."""
    try:
        # Without standalone mode click returns (not raises) a command's typer.Exit
        # code: `areno check` exits 1 on a FAIL line only if that code is passed on.
        rc = app(args=argv, standalone_mode=False)
        if rc == 130:  # typer turns a KeyboardInterrupt into this status
            print("areno: interrupted", file=sys.stderr)
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

