"""`dspark-flow` command line. Every user error ends as one line on stderr and exit code 2;
an unexpected failure as one line and exit code 1 (DSPARK_FLOW_DEBUG=1 shows the traceback)."""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from dspark_flow.env import env_flag
from dspark_flow.errors import DsparkFlowError


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-format",
        choices=["console", "json"],
        default="console",
        help="console (default) or json lines",
    )
    p.add_argument(
        "--log-level",
        type=str.lower,
        choices=["debug", "info", "warning", "error"],
        default="warning",
        help="debug, info, warning (default), error",
    )


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (argparse prints its whole usage block first);
    subcommands' parsers are made of the same class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from dspark_flow.cli import commands

    parser = OneLineParser(
        prog="dspark-flow",
        description="Lossless speculative decoding for MLX language models.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in commands.COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(p)
        _add_common(p)
        p.set_defaults(handler=command.run)
    return parser


def _version() -> str:
    from dspark_flow import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from dspark_flow.log import configure

    configure(args.log_format, args.log_level)
    try:
        return int(args.handler(args) or 0)
    except DsparkFlowError as exc:
        if exc.__cause__ is not None and env_flag("DSPARK_FLOW_DEBUG"):
            traceback.print_exception(exc.__cause__)  # e.g. where a plugin's warm_up failed
        for line in str(exc).splitlines() or [type(exc).__name__]:
            print(f"error: {line}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:  # a message says what was lost (the bench's warm-up)
        print(f"interrupted: {exc}" if str(exc) else "interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except ModuleNotFoundError as exc:
        if (exc.name or "dspark_flow").split(".")[0] == "dspark_flow":
            return _internal_error(exc)  # one of ours: a bug
        # An install without its dependencies (pip --no-deps, a partial copy).
        print(
            f"error: the Python package {exc.name!r} is missing: install dspark-flow with its "
            "dependencies (pip install dspark-flow)",
            file=sys.stderr,
        )
        return 1
    except MemoryError as exc:  # a user's setting asked for too much, rarely our bug
        print(
            f"error: out of memory ({str(exc) or 'MemoryError'}): try a smaller model, batch, "
            "max_tokens or training setting",
            file=sys.stderr,
        )
        return 1
    except Exception as exc:
        return _internal_error(exc)


def _internal_error(exc: Exception) -> int:
    """An internal bug: still one line unless asked for more."""
    if env_flag("DSPARK_FLOW_DEBUG"):
        traceback.print_exc()
    first = (str(exc).strip().splitlines() or [""])[0]  # e.g. pydantic's span several lines
    print(
        f"internal error: {type(exc).__name__}: {first} (set DSPARK_FLOW_DEBUG=1 for a traceback)",
        file=sys.stderr,
    )
    return 1


def print_json(data: object) -> None:
    json.dump(data, sys.stdout, indent=2, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    sys.exit(main())
