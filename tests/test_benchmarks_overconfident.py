"""benchmarks/patches_overconfident.py: its diagnostics against closed forms, and a smoke run."""

import math

import pytest
import torch

from benchmarks.patches_overconfident import (
    component_spread,
    main,
    mutual_information,
    overconfident_split,
)
from benchmarks.protocols import bn_mlp
from pyro_subspace import PatchedNet, likelihoods

pytestmark = pytest.mark.usefixtures("one_thread")


def test_mutual_information_of_agreeing_and_opposite_draws():
    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    assert mutual_information(p.expand(4, 2, 3)) == pytest.approx(0.0, abs=1e-6)
    # two one-hot draws that disagree: mean is (1/2, 1/2), each draw has zero entropy
    eye = torch.eye(2)[:, None, :]  # (S=2, N=1, C=2)
    assert mutual_information(eye) == pytest.approx(math.log(2), rel=1e-5)


def test_component_spread_is_rms_distance_over_rms_of_the_mean():
    net = bn_mlp(4, 3, hidden=5, seed=0)
    model = PatchedNet(net, likelihoods.Categorical(), mode="emp", n_components=2, sigma=0.0)
    with torch.no_grad():  # components c ± d: spread |d| / |c| elementwise-constant
        for s in model.slots:
            if s.kind == "patch":
                m = model.means()[s.name]
                m[0].fill_(2.0)
                m[1].fill_(1.0)
    spread = component_spread(model)
    assert set(spread) == {"1.weight", "1.bias", "4.weight", "4.bias", "6.weight", "6.bias"}
    assert all(v == pytest.approx(0.5 / 1.5) for v in spread.values())


def test_split_is_stratified_disjoint_and_standardised_with_training_statistics():
    split = overconfident_split(0, 100)
    assert split["x"].shape == (100, 64) and split["y_test"].shape == (1697,)
    assert torch.bincount(split["y"], minlength=10).min() >= 9
    assert split["x"].mean(0).abs().max() < 1e-5
    for xt in split["tests"].values():
        assert xt.shape == (1697, 64)
    assert not torch.equal(split["tests"]["clean"], split["tests"]["rot15"])


def test_quick_run_reports_every_method_and_shift():
    out = main(["--quick"])
    for shift in ("clean", "rot15", "rot30", "noise4"):
        for method in ("vanilla", "dropout", "emp", "ecmp", "deep_ens"):
            r = out["results"][method][shift]
            assert len(r["ece"]) == 1 and 0.0 <= r["ece"][0] <= 1.0
        assert out["results"]["vanilla"][shift]["mi"] == [0.0]
