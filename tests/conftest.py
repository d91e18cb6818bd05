"""Shared test set-up: fixed seeds, a clean param store and Pyro's validation for every test."""

import os
import sys
from pathlib import Path

import pyro
import pytest
import torch

# benchmarks/ (paper protocols, OOD constructions) is not installed: its tests import it from here
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def pytest_configure(config):
    """The test run pins torch to one thread (override with PYRO_SUBSPACE_TEST_THREADS=n).

    The suite's networks are small; on a shared 2-core machine torch's default of two
    threads made a small-net step up to 17x slower than one thread, and the suite's time
    then depended on whoever else was running.
    """
    torch.set_num_threads(int(os.environ.get("PYRO_SUBSPACE_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _seeded_and_clean():
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    pyro.enable_validation(True)
    yield
    pyro.clear_param_store()


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    """Runs a test once per device: ``torch.device("cpu")`` and ``torch.device("cuda")``, the
    latter skipped when ``torch.cuda.is_available()`` is False. A test taking it builds its
    network and data on the CPU (same seeds) and moves them with ``.to(device)``, so the same
    assertion checks that nothing inside creates tensors on the wrong device."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    return torch.device(request.param)


@pytest.fixture
def one_thread():
    """Tiny nets (and hundreds of tiny SVDs) run fastest on one thread; extra threads only
    add overhead and contend on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def usage_error(capsys):
    """``usage_error(argv)`` runs ``pyro-subspace argv``, expects argparse's usage error
    (exit status 2) and returns what it printed to stderr."""
    from pyro_subspace import cli

    def run(argv):
        with pytest.raises(SystemExit) as exit_:
            cli.execute(argv)
        assert exit_.value.code == 2
        return capsys.readouterr().err

    return run


def conjugate_posterior(x, y, sigma, prior_scale, temperature=1.0):
    """Closed-form posterior of ``t`` for ``y ~ N(x t, σ²)``, ``t ~ N(0, s² I)``, likelihood^(1/T).

    Returns the mean ``(K,)`` and covariance ``(K, K)``, computed with dense linear algebra.
    """
    k = x.shape[1]
    precision = x.T @ x / (temperature * sigma**2) + torch.eye(k, dtype=x.dtype) / prior_scale**2
    cov = torch.linalg.inv(precision)
    mean = cov @ (x.T @ y) / (temperature * sigma**2)
    return mean, cov
