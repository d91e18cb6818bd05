import json

import pytest

from pyro_subspace import cli

TINY = ["--epochs", "30", "--swa-epochs", "12", "--samples", "12", "--warmup", "8", "--no-progress"]


def test_default_run_writes_table_json_and_png(tmp_path, capsys):
    results = cli.execute(TINY + ["--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "MAP (SWA)" in printed and "PCA+ESS" in printed
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rows"] == results["rows"]
    # temperature "auto" is N/K: 400 toy points, K = 10
    assert results["rank"] == 10 and results["temperature"] == pytest.approx(40.0)
    for row in results["rows"].values():
        assert 0.0 <= row["coverage95"] <= 1.0 and row["rmse"] > 0
    png = (tmp_path / "toy_pca_ess.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_random_subspace_with_vi_on_diabetes(tmp_path):
    results = cli.execute(
        TINY
        + [
            "--dataset",
            "diabetes",
            "--subspace",
            "random",
            "--rank",
            "3",
            "--inference",
            "vi",
            "--temperature",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    assert set(results["rows"]) == {"MAP (SWA)", "RANDOM+VI"}
    assert results["temperature"] == 2.0
    assert (tmp_path / "diabetes_random_vi.png").exists()


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--subspace", "random", "--rank", "mle"], "--rank mle needs --subspace pca"),
        (["--rank", "ten"], "--rank: expected an int"),
        (["--temperature", "hot"], "--temperature: expected a number"),
        (["--dataset", "csv"], "--dataset csv needs"),
        (["tutorial", "99"], "tutorial '99' not found"),
        (["--swa-epochs", "5"], "--rank 10: a PCA subspace needs at least as many SWA snapshots"),
    ],
)
def test_bad_arguments_exit_with_a_message(argv, match):
    with pytest.raises(SystemExit, match=match):
        cli.execute(argv)


def test_console_entry_point_returns_exit_status_zero(tmp_path):
    assert cli.main(TINY + ["--out", str(tmp_path)]) == 0


def test_nuts_inference_option(tmp_path):
    results = cli.execute(TINY + ["--inference", "nuts", "--rank", "2", "--out", str(tmp_path)])
    assert set(results["rows"]) == {"MAP (SWA)", "PCA+NUTS"}


def test_grid_subcommand_runs_tutorial_06(monkeypatch):
    ran = []
    monkeypatch.setattr(cli, "run_tutorial", ran.append)
    assert cli.execute(["grid"]) is None and ran == ["06"]
    with pytest.raises(SystemExit, match="usage: pyro-subspace grid"):
        cli.execute(["grid", "extra"])


@pytest.mark.parametrize("subspace", ["subnetwork", "ggn"])
def test_laplace_inference_in_a_subnetwork_or_ggn_subspace(tmp_path, subspace):
    argv = ["--dataset", "diabetes", "--subspace", subspace, "--rank", "4", "--temperature", "1"]
    results = cli.execute(TINY + argv + ["--inference", "laplace", "--out", str(tmp_path)])
    rows = results["rows"]
    assert results["rank"] == 4 and set(rows) == {
        "MAP (SWA)",
        f"{subspace.upper()}+LAPLACE",
        "LAPLACE (GLM)",
    }
    # the GLM predictive adds variance to the MAP's: intervals can only widen
    assert rows["LAPLACE (GLM)"]["coverage95"] >= rows["MAP (SWA)"]["coverage95"]
    assert rows["LAPLACE (GLM)"]["rmse"] == pytest.approx(rows["MAP (SWA)"]["rmse"], rel=0.05)
