"""``pyro-subspace mixture --inference mola|deep_ensemble|swag`` on tiny settings."""

import json

import pytest

from pyro_subspace import cli, datasets

TINY = ["mixture", "--dataset", "diabetes", "--epochs", "40", "--no-progress"]


@pytest.mark.parametrize(
    "inference, row, extra",
    [
        ("mola", "MoLA (2 nets)", ["--members", "2", "--laplace-prior", "fixed"]),
        ("mola", "MoLA (2 nets)", ["--members", "2", "--hessian", "kron"]),
        ("deep_ensemble", "DE (2 nets)", ["--members", "2"]),
        ("swag", "SWAG", ["--swa-epochs", "4", "--samples", "10"]),
    ],
)
def test_mixture_inference_runs_and_scores(tmp_path, capsys, inference, row, extra):
    results = cli.execute(TINY + extra + ["--inference", inference, "--out", str(tmp_path)])
    assert row in capsys.readouterr().out
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rows"] == results["rows"] and set(results["rows"]) == {"MAP", row}
    for r in results["rows"].values():
        assert 0.0 <= r["coverage95"] <= 1.0 and r["rmse"] > 0
        # the mixture NLL never exceeds the moment-matched one by much; both finite
        assert r["nll"] < 10 and r["nll_moment_matched"] < 10
    assert (tmp_path / f"diabetes_{inference}.png").read_bytes()[:4] == b"\x89PNG"


def test_auto_prior_precision_is_n_times_the_weight_decay(tmp_path):
    argv = TINY + ["--members", "2", "--laplace-prior", "fixed", "--weight-decay", "1e-3"]
    auto = cli.execute(argv + ["--out", str(tmp_path / "a")])
    n = datasets.diabetes().n_train
    explicit = cli.execute(argv + ["--prior-precision", str(n * 1e-3), "--out", f"{tmp_path}/b"])
    assert auto["rows"] == explicit["rows"]
    other = cli.execute(argv + ["--prior-precision", "50", "--out", str(tmp_path / "c")])
    assert other["rows"]["MAP"] == auto["rows"]["MAP"]  # the same networks ...
    assert other["rows"]["MoLA (2 nets)"] != auto["rows"]["MoLA (2 nets)"]  # ... another prior


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--members", "0"], "argument --members: expected an integer >= 1"),
        (["--inference", "swag", "--members", "3"], "--members only applies to --inference mola"),
        (["--samples", "5"], "--samples only applies to --inference swag"),
        (["--inference", "swag", "--hessian", "kron"], "--hessian only applies to --inference mola"),
        (["--inference", "deep_ensemble", "--prior-precision", "2"], "--prior-precision only"),
        (["--inference", "swag", "--swa-epochs", "1"], "--inference swag needs --swa-epochs >= 2"),
        (["--dataset", "digits"], "argument --dataset: invalid choice: 'digits'"),
        (["--prior-precision", "-1"], "expected a number > 0 or 'auto'"),
    ],
)
def test_options_the_method_does_not_use_are_errors(argv, match, usage_error):
    assert match in usage_error(["mixture", *argv])
