"""One-line errors for user mistakes: the CLI prints ``error: ...`` and exits 2 (1 for other
failures); the traceback only with ``tristream --debug``."""

from __future__ import annotations

import errno
import sys
from pathlib import Path

import typer


class UserError(Exception):
    """A mistake the user can fix (a bad option, a missing file, no server): its message says how."""


def check_device(device: str) -> None:
    """Refuse ``--device cuda`` where torch sees no CUDA device."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UserError(f"--device {device}: torch sees no CUDA device on this machine; "
                            "use --device cpu (or auto)")
    elif device not in ("cpu", "auto"):
        raise UserError(f"--device must be cpu, cuda or auto, not {device!r}")


def check_model(model: str | None) -> None:
    """Refuse a ``--model`` path that does not exist (a name without a slash may be resolved later)."""
    if model and ("/" in model or model.endswith(".gguf")) and not Path(model).exists():
        raise UserError(f"--model {model}: no such file or folder (give a .gguf file or a Hugging Face "
                        "folder with config.json; leave it out for the embedded SmolLM2)")


def user_message(exc: BaseException) -> str | None:
    """The one-line message for an exception a user caused, or None for a bug."""
    from tristream.engine.cli_support import ModelNotFound

    if isinstance(exc, UserError | ModelNotFound):
        return str(exc)
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return f"the port is already in use ({exc.strerror}): stop the other server or pass another --port"
    if isinstance(exc, ConnectionRefusedError) or (isinstance(exc, OSError) and "Connection refused" in str(exc)):
        return f"no server answered ({exc}): is `tristream serve` running at that address?"
    if isinstance(exc, FileNotFoundError | IsADirectoryError | PermissionError):
        return str(exc)
    if isinstance(exc, UnicodeDecodeError):
        return f"the input is not a text file ({exc.reason} at byte {exc.start}): check the file you passed"
    name = type(exc).__name__
    known = {"AuthError", "UnknownBackend", "ModelSetupError", "DemoInputError", "RecordingError",
             "ClientError", "URLError", "InvalidPacket", "JSONDecodeError"}
    if name in known:
        return f"{exc}" if name in ("AuthError", "UnknownBackend", "ModelSetupError", "DemoInputError",
                                    "RecordingError", "ClientError") else f"{name}: {exc}"
    return None


def run(app: typer.Typer, argv: list[str] | None = None) -> int:
    """Run the CLI; ``--debug`` anywhere in the arguments shows tracebacks instead of one line."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    if debug:
        args.remove("--debug")
    try:
        app(args=args, prog_name="tristream", standalone_mode=True)
    except SystemExit as e:
        return int(e.code) if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if debug:
            raise
        msg = user_message(exc)
        line = (msg if msg is not None else f"{type(exc).__name__}: {exc}").replace("\n", " ").strip()
        hint = "" if msg is not None else " (a bug? run with --debug for the traceback and report it)"
        typer.echo(f"error: {line}{hint}", err=True)
        return 2 if msg is not None else 1
    return 0
