"""The API reference: every docstring example runs (doctest), and Sphinx builds the docs with
warnings as errors (what CI's ``make test`` checks)."""

import doctest
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pyro
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from torch import nn

import pyro_subspace
from pyro_subspace import infer, likelihoods, subspaces

ROOT = Path(__file__).resolve().parents[1]
#: every module of the package except ``__main__`` ones (importing those runs the command)
MODULES = [
    m.name
    for m in pkgutil.walk_packages(pyro_subspace.__path__, "pyro_subspace.")
    if not m.name.endswith("__main__")
]
#: names the examples may use without importing them, as if after ``from pyro_subspace import *``
NAMESPACE = {
    "torch": torch,
    "nn": nn,
    "pyro": pyro,
    "SVI": SVI,
    "Trace_ELBO": Trace_ELBO,
    "Predictive": Predictive,
    **{name: getattr(pyro_subspace, name) for name in pyro_subspace.__all__},
    **{name: getattr(infer, name) for name in infer.__all__},
    **{name: getattr(subspaces, name) for name in subspaces.__all__},
    "Categorical": likelihoods.Categorical,
    "Gaussian": likelihoods.Gaussian,
}


def _examples():
    finder = doctest.DocTestFinder(exclude_empty=True)
    for name in MODULES:
        module = importlib.import_module(name)
        for test in finder.find(module, name, globs={**vars(module), **NAMESPACE}):
            if test.examples:
                yield pytest.param(test, id=test.name)


@pytest.mark.parametrize("test", list(_examples()))
def test_docstring_example_runs(test):
    torch.manual_seed(0)
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    with torch.random.fork_rng(devices=[]):
        result = runner.run(test, out=lambda text: print(text, end=""))
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"


def test_sphinx_builds_the_api_reference_with_warnings_as_errors(tmp_path):
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
    done = subprocess.run(
        [*cmd, str(ROOT / "docs"), str(tmp_path / "html")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    page = (tmp_path / "html" / "api.html").read_text()
    for name in ("SubspaceNet.forward", "to_inference_data", "MixtureOfLaplace", "PatchedNet"):
        assert name in page, name
