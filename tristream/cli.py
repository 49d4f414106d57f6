"""The `tristream` command line.

Each subcommand lives in its own module under `tristream.commands` and exposes
`register(app)`; modules import heavy dependencies (torch, models) inside the command
body so that `tristream --help` stays fast.
"""

from __future__ import annotations

import importlib
import importlib.util

import typer

app = typer.Typer(
    name="tristream",
    help="Real-time tri-modal AI runtime: align, generate, transcribe, chat, serve. "
         "Errors print one line; pass --debug for the traceback.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Order is the order shown in --help; a module that does not exist yet is skipped.
COMMAND_MODULES = (
    "demo",
    "align",
    "generate",
    "chat",
    "transcribe",
    "serve",
    "client",
    "top",
    "replay",
    "report",
)


def _register_all() -> None:
    for name in COMMAND_MODULES:
        modname = f"tristream.commands.{name}"
        if importlib.util.find_spec(modname) is None:
            continue
        importlib.import_module(modname).register(app)


_register_all()


def main() -> None:
    """The console entry point: one-line errors for user mistakes (`tristream.commands.errors`)."""
    import sys

    from tristream.commands.errors import run

    sys.exit(run(app))


if __name__ == "__main__":
    main()
