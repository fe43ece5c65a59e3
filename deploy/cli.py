"""`knot`: the project's one console script.

Each subcommand lives in its own module under deploy/commands/ and exposes
    NAME: str, HELP: str, add_arguments(parser), run(args) -> int
so that commands can be added without touching the others.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from common import settings

# Order is the order shown by `knot --help`.
COMMAND_MODULES = (
    "deploy.commands.fetch_model",
    "deploy.commands.encode",
    "deploy.commands.inspect",
    "deploy.commands.dump",
    "deploy.commands.generate",
    "deploy.commands.serve",
    "deploy.commands.cluster",
    "deploy.commands.compose",
    "deploy.commands.secrets_file",
    "deploy.commands.settings_table",
    "deploy.commands.bench",
    "deploy.commands.synth",
    "deploy.commands.deploy",
)


log = logging.getLogger("knot")


class CommandError(Exception):
    """A user-facing failure: printed as one line, exit status 1."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="knot",
        description="Distributed Qwen2 inference over Worker-shaped services. "
        "Weights live in one .knot object; see docs/knot-format.md.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module_name in COMMAND_MODULES:
        module = importlib.import_module(module_name)
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a record names as its command
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for name, guess in settings.unknown_knot_names(os.environ):
        log.warning("%s is set but is not a setting%s, so it is ignored (docs/configuration.md lists them)",
                    name, f" (did you mean {guess}?)" if guess else "")
    from deploy import kernels, llguidance_engine

    kernels.install()  # quantized matmul kernels when the C extension is built; numpy otherwise
    llguidance_engine.install_llguidance()  # constrained decoding (response_format, tool calls) where it imports
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("knot: interrupted", file=sys.stderr)
        return 130
    except (CommandError, ValueError, KeyError, OSError) as e:
        # One line, no traceback: every user-facing error names its problem.
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"knot {args.command}: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
