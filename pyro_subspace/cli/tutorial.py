"""``pyro-subspace tutorial NAME`` and ``pyro-subspace grid``: run a tutorial script."""

from __future__ import annotations

import argparse
import importlib.resources
import os
import runpy
import sys
from pathlib import Path

from . import options

GRID_TUTORIAL = "06"  # the subspace x inference grid (Subspace Inference, Figure 3)


def tutorial_folder() -> Path:
    """The tutorials shipped with the package (``pyro_subspace/tutorials``: in a source checkout
    a link to ``tutorials/``, in an installed copy package data)."""
    return Path(str(importlib.resources.files("pyro_subspace") / "tutorials"))


def find_tutorial(name: str) -> Path:
    """The tutorial script whose file name starts with ``name`` (e.g. ``"01"``)."""
    folder = tutorial_folder()
    matches = sorted(folder.glob(f"{name}*.py")) if folder.is_dir() else []
    if not matches:
        available = sorted(p.stem for p in folder.glob("[0-9]*.py")) if folder.is_dir() else []
        raise SystemExit(f"tutorial {name!r} not found in {folder}; available: {available}")
    return matches[0]


def run_tutorial(name: str, out: str | None = None, tiny: bool = False) -> None:
    """Run a tutorial (e.g. ``pyro-subspace tutorial 01``) from the installed package or a
    source checkout; its folder is importable meanwhile (tutorials 03-04 import ``benchmarks``).
    ``out`` sets ``$PYRO_SUBSPACE_OUT`` (where its PNGs go) and ``tiny`` sets
    ``PYRO_SUBSPACE_TINY=1`` (every setting shrunk) for the run; both are restored after."""
    script = find_tutorial(name)
    saved = {key: os.environ.get(key) for key in ("PYRO_SUBSPACE_OUT", "PYRO_SUBSPACE_TINY")}
    if out is not None:
        os.environ["PYRO_SUBSPACE_OUT"] = out
    if tiny:
        os.environ["PYRO_SUBSPACE_TINY"] = "1"
    folder = os.environ.get("PYRO_SUBSPACE_OUT", "out")
    print(f"running {script} (PNGs go to {folder})", flush=True)
    sys.path.insert(0, str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.path.remove(str(script.parent))
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _script_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="folder for the PNGs (default: ./out)")
    parser.add_argument(
        "--tiny", action="store_true", help="shrink every setting (a smoke run of seconds)"
    )


def add_parsers(commands: argparse._SubParsersAction) -> None:
    t = options.command_parser(
        commands,
        "tutorial",
        "run a tutorial script (shipped with the package)",
        "Run a tutorial script; PYRO_SUBSPACE_TINY=1 shrinks its settings.",
    )
    t.add_argument("name", help="the tutorial's number or name prefix, e.g. 01")
    _script_options(t)
    t.set_defaults(run=lambda args: run_tutorial(args.name, args.out, args.tiny))
    g = options.command_parser(
        commands,
        "grid",
        "random/PCA/curve subspaces x VI/flow/ESS/NUTS (paper Fig. 3; tutorial 06)",
        "The Subspace Inference grid of subspaces x inference methods (tutorial 06); writes "
        "06_subspace_grid.png to --out.",
    )
    _script_options(g)
    g.set_defaults(run=lambda args: run_tutorial(GRID_TUTORIAL, args.out, args.tiny))
