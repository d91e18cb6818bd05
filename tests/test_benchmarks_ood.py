"""benchmarks/ood.py: rotated digits and the OOD sets (noise, permuted, scaled, held-out)."""

import pytest
import torch
from sklearn.datasets import load_digits

from benchmarks import ood
from pyro_subspace import datasets


@pytest.fixture(scope="module")
def data():
    return datasets.digits(seed=0)


def _raw(data, x):
    return x * data.x_std + data.x_mean


def test_noise_is_uniform_over_the_raw_pixel_range(data):
    x = ood.ood_digits(data, "noise", seed=1)
    assert x.shape == data.x_test.shape and x.dtype == torch.float32
    raw = _raw(data, x)
    assert raw.min() >= -1e-4 and raw.max() <= 16 + 1e-3
    # mean 8 and variance 16²/12 of U(0, 16), within 5 standard errors
    n = raw.numel()
    assert abs(raw.mean().item() - 8.0) < 5 * (16 / 12**0.5) / n**0.5
    assert raw.var().item() == pytest.approx(256 / 12, rel=0.03)
    assert torch.equal(x, ood.ood_digits(data, "noise", seed=1))
    assert not torch.equal(x, ood.ood_digits(data, "noise", seed=2))


def test_permuted_digits_keep_each_images_pixels(data):
    x = ood.ood_digits(data, "permuted", seed=3)
    raw, raw_test = _raw(data, x), _raw(data, data.x_test)
    # the same multiset of pixel values per image, in a different order
    assert torch.allclose(raw.sort(1).values, raw_test.sort(1).values, atol=1e-4)
    assert not torch.allclose(raw, raw_test, atol=1e-4)
    # one permutation for all images: find it from the first image's distinct values
    gen = torch.Generator().manual_seed(3)
    perm = torch.randperm(64, generator=gen)
    assert torch.allclose(raw, raw_test[:, perm], atol=1e-4)


def test_scaled_is_delta_times_the_standardised_test_inputs(data):
    for delta in (10, 100.0, 1000):
        assert torch.equal(ood.ood_digits(data, "scaled", delta=delta), data.x_test * delta)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kind": "blur"}, "kind"),
        ({"kind": "scaled"}, "delta"),
        ({"kind": "scaled", "delta": -1.0}, "delta"),
        ({"kind": "noise", "delta": 10.0}, "delta"),
    ],
)
def test_bad_arguments_name_themselves(data, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ood.ood_digits(data, **kwargs)
    with pytest.raises(ValueError, match="data"):
        ood.ood_digits(datasets.diabetes(), "noise")


def test_held_out_classes_split_relabels_and_standardises():
    data, x_ood = ood.digits_split_classes(seed=0, in_classes=(0, 1, 2, 3, 4))
    raw = load_digits()
    n_in = int((raw.target < 5).sum())
    assert data.n_classes == 5 and data.name == "digits"
    assert data.n_train + data.x_test.shape[0] == n_in
    assert x_ood.shape == (int((raw.target >= 5).sum()), 64)
    assert set(data.y_train.tolist()) == {0, 1, 2, 3, 4}
    # OOD images use the in-distribution training statistics
    back = x_ood * data.x_std + data.x_mean
    assert torch.allclose(back, torch.as_tensor(raw.data[raw.target >= 5]).float(), atol=1e-3)
    # relabelling follows the order of in_classes
    other, _ = ood.digits_split_classes(seed=0, in_classes=(9, 3))
    first = torch.as_tensor(raw.data[raw.target == 9][:1]).float()
    sel = ((other.x_train * other.x_std + other.x_mean) - first).abs().sum(1) < 1e-3
    sel_test = ((other.x_test * other.x_std + other.x_mean) - first).abs().sum(1) < 1e-3
    labels = torch.cat([other.y_train[sel], other.y_test[sel_test]])
    assert labels.tolist() == [0]
    with pytest.raises(ValueError, match="in_classes"):
        ood.digits_split_classes(in_classes=(1, 1))
    with pytest.raises(ValueError, match="in_classes"):
        ood.digits_split_classes(in_classes=(3, 12))


def test_rotate_images_quarter_turn_is_exact_and_matches_rot90():
    raw = torch.as_tensor(load_digits().data[:5], dtype=torch.float32)
    turned = ood.rotate_images(raw, 90.0)
    # counter-clockwise by 90 degrees == torch.rot90 on (row, col) images, up to rounding
    expected = torch.rot90(raw.reshape(-1, 8, 8), 1, dims=(1, 2)).reshape(-1, 64)
    assert torch.allclose(turned, expected, atol=1e-4)
    assert torch.equal(ood.rotate_images(raw, 0.0), raw)
    with pytest.raises(ValueError, match="images"):
        ood.rotate_images(raw[:, :10], 30.0)


def test_rotated_digits_keeps_the_standardisation():
    d = datasets.digits(seed=0)
    same = ood.rotated_digits(d, 0.0)
    assert torch.allclose(same, d.x_test, atol=1e-5)
    turned = ood.rotated_digits(d, 180.0)
    raw = d.x_test * d.x_std + d.x_mean
    flipped = torch.flip(raw.reshape(-1, 8, 8), dims=(1, 2)).reshape(-1, 64)
    assert torch.allclose(turned, (flipped - d.x_mean) / d.x_std, atol=1e-3)
    with pytest.raises(ValueError, match="data"):
        ood.rotated_digits(datasets.diabetes(), 15.0)


# ------------------------------------------- the rows of benchmarks/ood_digits.py and mola_vs_de.py


def _tiny_args():
    import argparse

    return argparse.Namespace(members=2, epochs=2, swa_epochs=2, hidden=8, weight_decay=5e-4)


def _check_rows(preds, laplace, data, seed):
    """Each Laplace row has the structure its legend states (the full-GGN rows explicitly
    'full', the K-FAC rows 'kron'), and MAP + TS is the first network's temperature scaling fitted
    on the benchmark's validation split."""
    from benchmarks.ood_digits import split_validation
    from pyro_subspace.infer import TemperatureScaling
    from pyro_subspace.infer.laplace.posteriors import FullPosterior, KronPosterior

    kinds = {"full": FullPosterior, "kron": KronPosterior}
    for name, (k, structure) in laplace.items():
        la = preds[name]
        assert la.hessian_structure == structure, name
        assert len(la.members) == (1 if k == 1 else 2), name
        for _, guide in la.members:
            assert guide.hessian_structure == structure, name
            assert isinstance(guide.posterior, kinds[structure]), name
    _, _, x_val, y_val = split_validation(data, seed)
    first = preds["MAP"].nets[0]
    ts = preds["MAP + TS"]
    assert ts.net is first
    expected = TemperatureScaling(first).fit(x_val, y_val).temperature
    assert torch.equal(ts.temperature, expected)


def test_ood_digits_rows_use_the_structures_their_legend_states():
    from benchmarks import ood_digits

    data = datasets.digits(seed=0)
    built, _ = ood_digits.build(data, _tiny_args(), 0)
    assert set(built) == set(ood_digits.METHODS)
    _check_rows({n: p for n, (p, _) in built.items()}, ood_digits.LAPLACE, data, 0)


def test_mola_vs_de_rows_use_the_structures_their_legend_states():
    from benchmarks import mola_vs_de

    data = datasets.digits(seed=1)
    preds, (_, new) = mola_vs_de.build(data, _tiny_args(), 1)
    assert set(preds) == set(mola_vs_de.METHODS)
    laplace = {
        "LLLA": (1, "full"),
        "MoLA": (None, "full"),
        "MoLA-LL": (None, "full"),
        "KFAC-LLLA": (1, "kron"),
        "MoLA (K-FAC)": (None, "kron"),
    }
    _check_rows(preds, laplace, data, 1)
    assert set(new) == {"KFAC-LLLA", "MoLA (K-FAC)", "T (MAP + TS)"}
