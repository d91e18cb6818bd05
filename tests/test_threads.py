"""The thread policy (`pyro_subspace.threads`): sets torch's thread count inside library calls
and restores the caller's afterwards."""

import pytest
import torch
from torch import nn

import pyro_subspace
from pyro_subspace import likelihoods, threads


@pytest.fixture(autouse=True)
def _clean_policy(monkeypatch):
    """Each test starts from no process-wide setting, no environment variable, and two threads
    (so that setting one is observable), and leaves torch's count as it found it."""
    monkeypatch.delenv(threads.ENV_VAR, raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    threads.set_num_threads(None)
    torch.set_num_threads(before)


class Recorder(nn.Module):
    """A linear net that records ``torch.get_num_threads()`` at every forward pass."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.seen = []

    def forward(self, x):
        self.seen.append(torch.get_num_threads())
        return self.lin(x)


def test_context_sets_and_restores():
    with threads.num_threads(1) as n:
        assert n == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), threads.num_threads(1):  # restored on error too
        raise RuntimeError
    assert torch.get_num_threads() == 2
    with threads.num_threads("torch") as n:  # leaves torch's setting alone
        assert n == 2


def test_precedence_set_over_env_over_auto(monkeypatch):
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    assert threads.resolve_num_threads() == 1  # auto, few cores
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 64)
    assert threads.resolve_num_threads() is None  # auto, many cores: torch's own setting
    monkeypatch.setenv(threads.ENV_VAR, "3")
    assert threads.resolve_num_threads() == 3
    pyro_subspace.set_num_threads("torch")
    assert threads.resolve_num_threads() is None
    pyro_subspace.set_num_threads(1)
    assert threads.resolve_num_threads() == 1
    pyro_subspace.set_num_threads(None)  # back to the environment
    assert threads.resolve_num_threads() == 3


def test_fit_map_runs_with_the_policy_and_restores(monkeypatch):
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    net = Recorder()
    x, y = torch.randn(8, 3), torch.randn(8)
    pyro_subspace.fit_map(net, likelihoods.Gaussian(1.0), x, y, epochs=2, progress=False)
    assert net.seen and set(net.seen) == {1}
    assert torch.get_num_threads() == 2
    net.seen.clear()
    with pytest.MonkeyPatch.context() as m:
        m.setenv(threads.ENV_VAR, "torch")
        pyro_subspace.fit_map(net, likelihoods.Gaussian(1.0), x, y, epochs=1, progress=False)
    assert set(net.seen) == {2}


def test_a_num_threads_block_reaches_the_library_calls_inside_it(monkeypatch):
    # the process-wide policy says one thread (auto on 2 cores); `with num_threads(3)` and
    # `with num_threads("torch")` override it for the calls inside, and nest
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    net = Recorder()
    x, y = torch.randn(8, 3), torch.randn(8)
    calls = []

    def fit():
        net.seen.clear()
        pyro_subspace.fit_map(net, likelihoods.Gaussian(1.0), x, y, epochs=1, progress=False)
        calls.append(set(net.seen))

    with threads.num_threads(3):
        fit()
        with threads.num_threads("torch"):
            fit()
        fit()
    fit()
    assert calls == [{3}, {3}, {3}, {1}]  # the "torch" block left the enclosing block's 3
    assert torch.get_num_threads() == 2


def test_cli_restores_threads(monkeypatch):
    """The command line runs under the policy and gives the caller its setting back."""
    import argparse
    import importlib

    cli_main = importlib.import_module("pyro_subspace.cli.main")
    seen = []
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("fit").set_defaults(run=lambda args: seen.append(torch.get_num_threads()))
    monkeypatch.setattr(cli_main, "build_parser", lambda: parser)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    cli_main.execute(["fit"])
    assert seen == [1] and torch.get_num_threads() == 2


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "many", ""])
def test_bad_settings_are_rejected(bad, monkeypatch):
    if bad == "":
        monkeypatch.setenv(threads.ENV_VAR, "0")
        with pytest.raises(ValueError, match=threads.ENV_VAR):
            threads.resolve_num_threads()
        return
    with pytest.raises(ValueError, match="value"):
        pyro_subspace.set_num_threads(bad)
    with pytest.raises(ValueError, match="value"):
        with threads.num_threads(bad):
            pass
