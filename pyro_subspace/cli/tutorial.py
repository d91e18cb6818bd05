"""``pyro-subspace tutorial NAME`` and ``pyro-subspace grid``: run a tutorial script."""

from __future__ import annotations

import argparse
import runpy
from pathlib import Path

from . import options

GRID_TUTORIAL = "06"  # the subspace x inference grid (Subspace Inference, Figure 3)


def run_tutorial(name: str) -> None:
    """Run ``tutorials/<name>*.py`` from a source checkout (e.g. ``pyro-subspace tutorial 01``)."""
    folder = Path(__file__).resolve().parents[2] / "tutorials"
    matches = sorted(folder.glob(f"{name}*.py")) if folder.is_dir() else []
    if not matches:
        available = sorted(p.stem for p in folder.glob("*.py")) if folder.is_dir() else []
        raise SystemExit(f"tutorial {name!r} not found in {folder}; available: {available}")
    runpy.run_path(str(matches[0]), run_name="__main__")


def add_parsers(commands: argparse._SubParsersAction) -> None:
    t = options.command_parser(
        commands,
        "tutorial",
        "run tutorials/NAME*.py from a source checkout",
        "Run a tutorial script; PYRO_SUBSPACE_TINY=1 shrinks its settings.",
    )
    t.add_argument("name", help="the tutorial's number or name prefix, e.g. 01")
    t.set_defaults(run=lambda args: run_tutorial(args.name))
    g = options.command_parser(
        commands,
        "grid",
        "random/PCA/curve subspaces x VI/flow/ESS/NUTS (paper Fig. 3; tutorial 06)",
        "The Subspace Inference grid of subspaces x inference methods (tutorial 06); writes "
        "out/06_subspace_grid.png.",
    )
    g.set_defaults(run=lambda args: run_tutorial(GRID_TUTORIAL))
