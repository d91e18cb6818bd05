"""The ``pyro-subspace`` command: argparse subcommands sharing one report module.

- ``fit`` (the default when no subcommand is given): MAP/SWA -> subspace -> ESS/NUTS/HMC/VI/Laplace
  on regression data (`pyro_subspace.cli.fit`);
- ``mixture``: MoLA, deep ensemble or SWAG on regression data (`pyro_subspace.cli.mixture`);
- ``patch``: Ensemble Model Patching vs the vanilla network on classification data
  (`pyro_subspace.cli.patch`);
- ``grid``, ``tutorial NAME``: run a tutorial script (`pyro_subspace.cli.tutorial`).

Each writes ``results.json`` and a PNG to ``--out`` and prints a table (`pyro_subspace.cli.report`).
"""

from .main import build_parser, execute, main

__all__ = ["build_parser", "execute", "main"]
