"""pyro-subspace --inference mola|deep_ensemble|swag on tiny settings."""

import json

import pytest

from pyro_subspace import cli

TINY = ["--epochs", "40", "--swa-epochs", "4", "--samples", "10", "--no-progress"]


@pytest.mark.parametrize(
    "inference, row, extra",
    [
        ("mola", "MoLA (2 nets)", ["--members", "2", "--laplace-prior", "fixed"]),
        ("deep_ensemble", "DE (2 nets)", ["--members", "2"]),
        ("swag", "SWAG", []),
    ],
)
def test_mixture_inference_runs_and_scores(tmp_path, capsys, inference, row, extra):
    results = cli.execute(
        TINY + extra + ["--dataset", "diabetes", "--inference", inference, "--out", str(tmp_path)]
    )
    assert row in capsys.readouterr().out
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rows"] == results["rows"] and set(results["rows"]) == {"MAP", row}
    for r in results["rows"].values():
        assert 0.0 <= r["coverage95"] <= 1.0 and r["rmse"] > 0
        # the mixture NLL never exceeds the moment-matched one by much; both finite
        assert r["nll"] < 10 and r["nll_moment_matched"] < 10
    assert (tmp_path / f"diabetes_{inference}.png").read_bytes()[:4] == b"\x89PNG"


def test_mixture_members_must_be_positive(tmp_path):
    with pytest.raises(SystemExit, match="members"):
        cli.execute(["--inference", "mola", "--members", "0", "--out", str(tmp_path)])
