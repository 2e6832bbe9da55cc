"""``ds-async-ckpt``: the command line's parser and entry point.

Each subcommand lives in its own module with an ``add_parser(sub)`` that registers it and sets
``func`` (``args -> exit code``): ``plan`` (:mod:`.plan_cmd`), ``verify`` (:mod:`.verify_cmd`)
and ``list`` (:mod:`.list_cmd`); add another by registering its module in :func:`build_parser`.

Exit codes: 0 success, 1 ``verify`` found a checkpoint damaged, partial or unfinalized, 2
invalid input (message on stderr as ``error: ...``): no such directory, not this engine's; 141
the reader of standard output went away (``ds-async-ckpt list ckpt | head``), as for a
command the shell sees killed by SIGPIPE.

    ds-async-ckpt list ckpt
    python -m deepspeed_async_ckpt.tools.cli verify ckpt
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import sys
from typing import Optional, Sequence

from . import list_cmd, plan_cmd, verify_cmd
from .errors import CliError

PROG = "ds-async-ckpt"

#: The exit code of a command whose standard output was closed early: what the shell reports
#: for a process killed by SIGPIPE (128 + 13), as ``yes | head`` gives; ``set -o pipefail``
#: scripts see the listing was cut short, and everyone else sees ``head``'s status.
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


class _Parser(argparse.ArgumentParser):
    # Report usage errors through main() instead of exiting from inside argparse.
    def error(self, message):
        raise CliError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Async checkpointing tools for DeepSpeed/Megatron.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    plan_cmd.add_parser(sub)
    verify_cmd.add_parser(sub)
    list_cmd.add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if getattr(args, "func", None) is None:
            parser.print_help(sys.stderr)
            return 2
        code = args.func(args)
        sys.stdout.flush()  # here, not at exit: a closed pipe is then handled below
        return code
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE


def _silence_stdout() -> None:
    """Point standard output at /dev/null, so that the interpreter's flush at exit, which
    writes what is still buffered, does not fail on the closed pipe again (and print
    ``Exception ignored ... BrokenPipeError``)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):  # replaced (tests capture it)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
