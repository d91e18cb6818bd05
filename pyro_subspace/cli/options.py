"""Options and helpers shared by the subcommands: data, network, training and run settings.

Every option means one thing in every subcommand that has it; an option that a subcommand has
but the chosen method does not use is an error (`reject_unused`), never silently ignored.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import pyro
import torch
from torch import nn

from .. import datasets

REGRESSION_DATA = ("toy", "in_between", "diabetes", "csv")
AUTO_HIDDEN = {"toy": (200, 50, 50, 50)}  # Subspace Inference 3.1; otherwise (50,): G.1.2
DEFAULT_HIDDEN = (50,)
#: hidden-layer activations: ReLU (the papers') and smooth ones, whose loss has no kinks, so
#: that a Laplace MAP search can drive its gradient to zero
ACTIVATIONS = {"relu": nn.ReLU, "softplus": nn.Softplus, "tanh": nn.Tanh, "silu": nn.SiLU}


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every option's default (not the empty ones) and keeps the descriptions' lines."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class UsageError(ValueError):
    """A combination of options that does not make sense; reported by argparse's ``error``."""


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer ``>= minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


def _float_type(name: str, ok: Callable[[float], bool], what: str) -> Callable[[str], float]:
    """An argparse ``type``: a number for which ``ok`` holds (NaN and text never do)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = parse.__qualname__ = name
    parse.__doc__ = f"An argparse ``type``: {what}."
    return parse


positive_float = _float_type("positive_float", lambda v: 0 < v < math.inf, "a number > 0")
nonneg_float = _float_type("nonneg_float", lambda v: 0 <= v < math.inf, "a number >= 0")
probability = _float_type("probability", lambda v: 0 < v < 1, "a number in (0, 1)")


def number_or(word: str, kind: Callable[[str], object], what: str) -> Callable[[str], object]:
    """An argparse ``type``: the literal ``word``, or a value parsed by ``kind`` (``what``)."""

    def parse(text: str) -> object:
        if text == word:
            return word
        try:
            return kind(text)
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(f"expected {what} or {word!r}, got {text!r}") from None

    return parse


def output_dir(text: str) -> Path:
    """``--out``: a folder that exists or can be made, checked when the options are read
    (before any training), not when the results are written."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is an existing file, not a folder")
    parent = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: cannot write in {str(parent)!r}")
    return path


def widths(text: str) -> tuple[int, ...] | str:
    """An argparse ``type``: comma-separated hidden-layer widths (``200,50``), or ``auto``."""
    if text == "auto":
        return text
    try:
        values = tuple(int(w) for w in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected widths like 200,50 or 'auto', got {text!r}")
    return values


def command_parser(
    commands: argparse._SubParsersAction,
    name: str,
    summary: str,
    doc: str,
    data: tuple[tuple[str, ...], str] | None = None,
) -> argparse.ArgumentParser:
    """A subcommand's parser: ``summary`` in the command list, ``doc`` (a module docstring,
    its first paragraph dropped) as the description; ``data = (choices, default)`` adds the
    ``--dataset``, ``--csv``, ``--target`` options."""
    p = commands.add_parser(
        name,
        help=summary,
        description=doc.split("\n\n", 1)[-1],
        formatter_class=Formatter,
        allow_abbrev=False,
    )
    if data is not None:
        _add_data_options(p, *data)
    return p


def _add_data_options(p: argparse.ArgumentParser, choices: tuple[str, ...], default: str) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--dataset", choices=choices, default=default, help="the data set")
    g.add_argument("--csv", type=Path, help="CSV file (with --dataset csv)")
    g.add_argument("--target", help="target column of the CSV (with --dataset csv)")


def add_network_options(
    p: argparse.ArgumentParser,
    *,
    hidden: str,
    hidden_help: str,
    epochs: int | str,
    lr: float,
    epochs_help: str = "training epochs (Adam)",
) -> argparse._ArgumentGroup:
    g = p.add_argument_group("network and training")
    g.add_argument("--hidden", type=widths, default=hidden, help=hidden_help)
    kind = int_at_least(0) if epochs != "auto" else number_or("auto", int_at_least(0), "an int")
    g.add_argument("--epochs", type=kind, default=epochs, help=epochs_help)
    g.add_argument("--lr", type=positive_float, default=lr, help="Adam learning rate")
    return g


def add_regression_training(
    p: argparse.ArgumentParser, weight_decay_help: str
) -> argparse._ArgumentGroup:
    """`add_network_options` with the regression defaults, plus ``--weight-decay``."""
    g = add_network_options(
        p,
        hidden="auto",
        hidden_help="hidden widths; 'auto': 200,50,50,50 on toy (Subspace Inference 3.1), "
        "else 50 (G.1.2)",
        epochs="auto",
        lr=1e-3,
        epochs_help="MAP epochs (full-batch Adam); 'auto': 2000 on toy and in_between (the "
        "papers'), else early stopping on a 20%% validation split of the training data",
    )
    g.add_argument("--weight-decay", type=nonneg_float, default=1e-4, help=weight_decay_help)
    return g


def add_laplace_prior(g: argparse._ArgumentGroup, method: str, start: str) -> None:
    g.add_argument(
        "--laplace-prior",
        choices=("marglik", "fixed"),
        default="marglik",
        help=f"{method}: tune the prior precision by the Laplace evidence, or keep {start}",
    )


#: the ``--hessian`` choices: `AutoSubspaceLaplace`'s ``hessian_structure``
HESSIANS = ("full", "diag", "lowrank", "kron", "auto")


def add_hessian(g: argparse._ArgumentGroup, method: str, default: str) -> None:
    g.add_argument(
        "--hessian",
        choices=HESSIANS,
        default=default,
        help=f"{method}: the posterior's structure: full GGN, its diagonal, low rank, K-FAC "
        "(kron: the MoLA paper's; needs whole layers), or auto (full while its two float64 (K, K) "
        "matrices fit 128 MiB, K <= 2896, else kron)",
    )


def add_swa_options(g: argparse._ArgumentGroup, what: str) -> None:
    g.add_argument("--swa-epochs", type=int_at_least(0), default=200, help=f"{what} epochs")
    g.add_argument("--swa-lr", type=positive_float, default=3e-4, help="constant SGD rate of SWA")
    g.add_argument(
        "--max-snapshots", type=int_at_least(1), default=20, help="SWA snapshots kept (last ones)"
    )


def add_run_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run")
    g.add_argument(
        "--seed", type=int_at_least(0), default=0, help="seeds data split, init and inference"
    )
    g.add_argument(
        "--out", type=output_dir, default=Path("out"), help="directory for the PNG and JSON"
    )
    g.add_argument(
        "--no-progress", "--quiet", action="store_true", help="hide progress bars and messages"
    )


def given_options(argv: Iterable[str]) -> set[str]:
    """The long options written in ``argv`` (the parsers set ``allow_abbrev=False``)."""
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


def reject_unused(given: set[str], rules: dict[str, tuple[bool, str]]) -> None:
    """Raise `UsageError` for an option in ``given`` whose rule ``(applies, where)`` is false."""
    for option, (applies, where) in rules.items():
        if option in given and not applies:
            raise UsageError(f"{option} only applies {where}")


def check_data(args: argparse.Namespace, given: set[str]) -> None:
    """``--csv`` and ``--target`` go with ``--dataset csv`` and nothing else."""
    if args.dataset == "csv" and (args.csv is None or args.target is None):
        raise UsageError("--dataset csv needs --csv PATH and --target COLUMN")
    csv = (args.dataset == "csv", "with --dataset csv")
    reject_unused(given, {"--csv": csv, "--target": csv})


def load_data(args: argparse.Namespace, task: str) -> datasets.Dataset:
    """The ``--dataset`` split with ``--seed`` (a CSV is read as ``task``)."""
    if args.dataset == "csv":
        try:
            return datasets.from_csv(args.csv, args.target, task=task, seed=args.seed)
        except (OSError, ValueError, TypeError) as e:  # a bad file is a usage error, not a crash
            raise UsageError(f"--csv {args.csv}: {e}") from None
    return datasets.load(args.dataset, seed=args.seed)


def hidden_widths(args: argparse.Namespace) -> tuple[int, ...]:
    """``--hidden``, with ``auto`` resolved: 200-50-50-50 on toy, one layer of 50 otherwise."""
    if args.hidden == "auto":
        return AUTO_HIDDEN.get(args.dataset, DEFAULT_HIDDEN)
    return args.hidden


def mlp(
    n_in: int,
    hidden: tuple[int, ...],
    n_out: int,
    batchnorm: bool = False,
    activation: str = "relu",
) -> nn.Sequential:
    """``n_in-h1-[BN]-act-…-hk-[BN]-act-n_out`` (``act``: `ACTIVATIONS`, ReLU by default) with
    PyTorch's default initialisation."""
    layers: list[nn.Module] = []
    sizes = (n_in, *hidden)
    act = ACTIVATIONS[activation]
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b), *([nn.BatchNorm1d(b)] if batchnorm else []), act()]
    return nn.Sequential(*layers, nn.Linear(sizes[-1], n_out))


def seed_everything(seed: int) -> None:
    """Seed torch and Pyro and clear Pyro's parameter store."""
    torch.manual_seed(seed)
    pyro.set_rng_seed(seed)
    pyro.clear_param_store()
