"""benchmarks/protocols.py: the Ensemble Model Patching protocol, checked against the
``pyro-subspace patch`` command that implements the same recipe with flags."""

import pytest
import torch

from benchmarks.protocols import bn_mlp, train_method
from pyro_subspace import cli, datasets, metrics
from pyro_subspace.flat import num_weights

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bn_mlp_has_the_papers_layers_and_a_seeded_init():
    net = bn_mlp(64, 10, seed=3)
    assert num_weights(net) == 64 * 128 + 128 + 2 * 128 + 128 * 128 + 128 + 2 * 128 + 1290
    kinds = [type(m).__name__ for m in net]
    assert kinds == ["Linear", "BatchNorm1d", "ReLU"] * 2 + ["Linear"]
    same = bn_mlp(64, 10, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), same.parameters()))


@pytest.mark.parametrize("method", ["ecmp", "dropout"])
def test_the_cli_patch_command_reproduces_the_protocol(method, tmp_path):
    data = datasets.digits(seed=1)
    argv = ["patch", "--inference", method, "--epochs", "3", "--samples", "10", "--seed", "1"]
    results = cli.execute(argv + ["--no-progress", "--out", str(tmp_path)])
    for name in ("vanilla", method):
        trained = train_method(name, data, epochs=3, seed=1)
        torch.manual_seed(1)
        expected = metrics.classification_scores(trained.probs(data.x_test, 10), data.y_test)
        row = results["rows"][name]
        assert {k: row[k] for k in expected} == expected, name
        assert row["overhead_percent"] == pytest.approx(trained.overhead)
