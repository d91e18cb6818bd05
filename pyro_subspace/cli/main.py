"""Parse ``pyro-subspace [COMMAND] [OPTIONS]`` and run the subcommand."""

from __future__ import annotations

import argparse
import sys

from ..threads import num_threads
from . import fit, mixture, options, patch, tutorial

#: where the methods of the former single ``--inference`` flag went
MOVED = {**dict.fromkeys(mixture.INFERENCE, "mixture"), **dict.fromkeys(patch.INFERENCE, "patch")}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with the subcommands ``fit``, ``mixture``, ``patch``, ``grid``,
    ``tutorial``."""
    p = argparse.ArgumentParser(
        prog="pyro-subspace",
        description="Subspace, subnetwork, mixture and patch inference for a neural network. "
        "Without a COMMAND, runs 'fit' with the options given (e.g. 'pyro-subspace "
        "--inference nuts'). 'pyro-subspace COMMAND --help' lists a command's options.",
        formatter_class=options.Formatter,
        allow_abbrev=False,
    )
    commands = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (fit, mixture, patch):
        sub = module.add_parser(commands)
        sub.set_defaults(parser=sub)
    tutorial.add_parsers(commands)
    return p


def _legacy(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """Options without a command are ``fit``'s; point former mixture/patch modes to their
    command."""
    for i, arg in enumerate(argv):
        value = arg.partition("=")[2] if arg.startswith("--inference=") else None
        if arg == "--inference" and i + 1 < len(argv):
            value = argv[i + 1]
        if value in MOVED:
            command = MOVED[value]
            parser.error(f"--inference {value}: run 'pyro-subspace {command} --inference {value}'")
    return ["fit", *argv]


def execute(argv: list[str] | None = None) -> dict | None:
    """Run the command with ``argv``; returns the results dict (``None`` for tutorials)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = _legacy(parser, argv)
    args = parser.parse_args(argv)
    if hasattr(args, "check"):
        try:
            args.check(args, options.given_options(argv[1:]))
        except options.UsageError as e:
            args.parser.error(str(e))
    try:
        with num_threads():  # one torch thread on a few cores (PYRO_SUBSPACE_NUM_THREADS)
            return args.run(args)
    except options.UsageError as e:  # found while running, e.g. a bad --csv file
        args.parser.error(str(e))


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point (``pyro_subspace.cli:main``): exit status 0 on success."""
    execute(argv)
    return 0
