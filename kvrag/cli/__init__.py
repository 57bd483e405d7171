"""The ``kvrag`` console command.

Sub-commands are discovered, not listed: every module in this package that defines
``register(subparsers)`` adds its sub-parser there and binds its handler with
``parser.set_defaults(func=handler)``; a handler takes the parsed ``argparse.Namespace`` and
returns an int exit code. So a new sub-command is one new file, with no edit here.

A :class:`kvrag.errors.KVRagError` (bad input, missing model, ...) is printed as
``kvrag: error: <message>`` with exit code 2, like argparse's own usage errors. As a safety net,
so is a ``ValueError`` or ``OSError`` that a sub-command lets through (a bad value or an
unusable path it did not check itself). Anything else is a bug and keeps its traceback.
``kvrag --debug COMMAND ...`` shows the traceback of every error.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from kvrag.errors import KVRagError


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvrag")
    except Exception:  # noqa: BLE001 - running from a source tree that is not installed
        import kvrag

        return getattr(kvrag, "__version__", "unknown")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvrag",
        description="Precompute per-chunk KV caches and fuse them at query time to cut RAG time-to-first-token.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the full traceback of an error instead of the one-line 'kvrag: error: ...'",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        register = getattr(module, "register", None)
        if callable(register):
            register(subparsers)
    _plain_help(parser)
    return parser


def _plain_help(parser: argparse.ArgumentParser) -> None:
    """Help texts are written like docstrings (``code``); a terminal shows `code`."""

    def plain(text):
        return text.replace("``", "`") if isinstance(text, str) else text

    parser.description, parser.epilog = plain(parser.description), plain(parser.epilog)
    for action in parser._actions:
        action.help = plain(action.help)
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                choice.help = plain(choice.help)
            for sub in dict.fromkeys(action.choices.values()):
                _plain_help(sub)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvrag`` command with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:  # a sub-command module forgot set_defaults(func=...) on this parser
        parser.error(f"command {args.command!r} has no handler")
    try:
        code = func(args)
    except (KVRagError, ValueError, OSError) as e:
        # KVRagError: the user's problem, by design. ValueError / OSError: a bad value or an
        # unusable path a sub-command did not check itself; still the user's to fix, and a
        # traceback would hide the message. Everything else is a bug: traceback.
        if getattr(args, "debug", False):
            raise
        print(f"kvrag: error: {_message(e)}", file=sys.stderr)
        return 2
    return int(code or 0)


def _message(e: BaseException) -> str:
    return str(e).strip() or type(e).__name__
