"""``pyro-subspace`` / ``pyro-subspace fit``: the subspace-inference job, parsing and help."""

import json

import pytest
from sklearn.datasets import load_diabetes

from pyro_subspace import cli
from pyro_subspace.cli import tutorial

TINY = ["--epochs", "30", "--swa-epochs", "12", "--samples", "12", "--no-progress"]
MCMC = ["--warmup", "8"]


def _rows(results):
    return results["rows"]


def test_default_run_writes_table_json_and_png(tmp_path, capsys):
    results = cli.execute(TINY + MCMC + ["--out", str(tmp_path)])
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
    # the PSIS-LOO density of the training points: recorded, printed, and an estimate of the
    # out-of-sample density, so near the posterior's test log density (-test NLL)
    assert saved["loo_elpd_per_point"] == results["loo_elpd_per_point"]
    assert "PSIS-LOO of the training points" in printed
    test_density = -results["rows"]["PCA+ESS"]["nll"]
    assert abs(results["loo_elpd_per_point"] - test_density) < 0.5


def test_no_subcommand_is_fit_and_auto_hidden_is_the_papers_toy_net(tmp_path):
    argv = TINY + MCMC + ["--rank", "3"]
    plain = cli.execute(argv + ["--out", str(tmp_path / "a")])
    explicit = cli.execute(["fit", *argv, "--hidden", "200,50,50,50", "--out", str(tmp_path / "b")])
    assert _rows(plain) == _rows(explicit)
    other = cli.execute(["fit", *argv, "--hidden", "20", "--out", str(tmp_path / "c")])
    assert _rows(other) != _rows(plain)


def test_a_csv_file_reads_like_the_bundled_data(tmp_path):
    raw = load_diabetes(scaled=False)
    names = [f"x{j}" for j in range(raw.data.shape[1])]
    lines = [",".join([*names, "y"])]
    lines += [",".join(repr(float(v)) for v in [*row, t]) for row, t in zip(raw.data, raw.target)]
    (tmp_path / "mine.csv").write_text("\n".join(lines) + "\n")
    argv = TINY + ["--subspace", "random", "--rank", "3", "--inference", "laplace"]
    bundled = cli.execute(argv + ["--dataset", "diabetes", "--out", str(tmp_path / "a")])
    mine = cli.execute(
        argv
        + ["--dataset", "csv", "--csv", str(tmp_path / "mine.csv"), "--target", "y"]
        + ["--out", str(tmp_path / "b")]
    )
    assert mine["dataset"] == "mine" and _rows(mine) == _rows(bundled)


def test_random_subspace_with_vi_on_diabetes(tmp_path):
    argv = ["--dataset", "diabetes", "--subspace", "random", "--rank", "3", "--inference", "vi"]
    argv += ["--vi-steps", "40", "--temperature", "2", "--out", str(tmp_path)]
    results = cli.execute(TINY + argv)
    assert set(results["rows"]) == {"MAP (SWA)", "RANDOM+VI"}
    assert results["temperature"] == 2.0
    assert (tmp_path / "diabetes_random_vi.png").exists()


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--subspace", "random", "--rank", "mle"], "--rank mle needs --subspace pca"),
        (["--rank", "ten"], "argument --rank: expected an integer >= 1 or 'mle'"),
        (["--temperature", "hot"], "argument --temperature: expected a number > 0 or 'auto'"),
        (["fit", "--prior-scale", "0"], "argument --prior-scale: expected a number > 0"),
        (["--dataset", "csv"], "--dataset csv needs --csv PATH and --target COLUMN"),
        (["--csv", "my.csv"], "--csv only applies with --dataset csv"),
        (["--dataset", "digits"], "argument --dataset: invalid choice: 'digits'"),
        (["--swa-epochs", "5"], "--rank 10: a PCA subspace needs at least as many SWA snapshots"),
        (["--max-snapshots", "8"], "--rank 10: a PCA subspace needs at least as many"),
        (["--inference", "vi", "--warmup", "5"], "--warmup only applies to --inference ess"),
        (["--vi-steps", "5"], "--vi-steps only applies to --inference vi"),
        (["--laplace-prior", "fixed"], "--laplace-prior only applies to --inference laplace"),
        (["--subspace", "ggn", "--max-snapshots", "5"], "--max-snapshots only applies to"),
        (["--inference", "mola"], "run 'pyro-subspace mixture --inference mola'"),
        (["--inference=ecmp"], "run 'pyro-subspace patch --inference ecmp'"),
        (["--members", "3"], "unrecognized arguments: --members"),
        (["--epo", "3"], "unrecognized arguments: --epo"),  # no abbreviations
        (["grid", "extra"], "unrecognized arguments: extra"),
    ],
)
def test_bad_arguments_exit_with_a_message(argv, match, usage_error):
    assert match in usage_error(argv)


def test_missing_tutorial_names_the_available_ones():
    with pytest.raises(SystemExit, match="tutorial '99' not found.*01_subspace_regression"):
        cli.execute(["tutorial", "99"])


def test_help_lists_the_commands_and_every_default(capsys):
    with pytest.raises(SystemExit):
        cli.execute(["--help"])
    top = capsys.readouterr().out
    assert all(c in top for c in ("fit", "mixture", "patch", "grid", "tutorial"))
    with pytest.raises(SystemExit):
        cli.execute(["fit", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    text = text[text.index("options:") :]  # past the usage line
    for option, default in [
        ("--epochs", "auto"),
        ("--weight-decay", "0.0001"),
        ("--swa-lr", "0.0003"),
        ("--swa-batch-size", "50"),
        ("--hidden", "auto"),
        ("--rank", "10"),
        ("--temperature", "auto"),
    ]:
        start = text.index(f"{option} {option.lstrip('-').replace('-', '_').upper()}")
        assert f"(default: {default})" in text[start : text.index("--", start + len(option) + 1)]


def test_console_entry_point_returns_exit_status_zero(tmp_path):
    assert cli.main(TINY + MCMC + ["--rank", "2", "--out", str(tmp_path)]) == 0


def test_nuts_inference_option(tmp_path):
    argv = TINY + MCMC + ["--inference", "nuts", "--rank", "2", "--out", str(tmp_path)]
    assert set(cli.execute(argv)["rows"]) == {"MAP (SWA)", "PCA+NUTS"}


def test_grid_and_tutorial_subcommands_run_the_scripts(monkeypatch):
    ran = []
    monkeypatch.setattr(tutorial, "run_tutorial", lambda *a: ran.append(a))
    assert cli.execute(["grid"]) is None and cli.execute(["tutorial", "03"]) is None
    assert cli.execute(["tutorial", "01", "--out", "somewhere", "--tiny"]) is None
    assert ran == [("06", None, False), ("03", None, False), ("01", "somewhere", True)]


def test_a_tutorial_writes_its_pngs_to_out_and_restores_the_environment(monkeypatch, tmp_path):
    import os
    import runpy

    seen = {}

    def fake_run(path, run_name):  # what the script would read from its environment
        seen.update(
            out=os.environ.get("PYRO_SUBSPACE_OUT"), tiny=os.environ.get("PYRO_SUBSPACE_TINY")
        )

    monkeypatch.setattr(runpy, "run_path", fake_run)
    monkeypatch.delenv("PYRO_SUBSPACE_OUT", raising=False)
    monkeypatch.setenv("PYRO_SUBSPACE_TINY", "0")
    tutorial.run_tutorial("01", str(tmp_path), tiny=True)
    assert seen == {"out": str(tmp_path), "tiny": "1"}
    assert "PYRO_SUBSPACE_OUT" not in os.environ and os.environ["PYRO_SUBSPACE_TINY"] == "0"


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


def test_gess_inference_option_runs_the_generalised_kernel(tmp_path, monkeypatch):
    """--inference gess runs `GeneralizedEllipticalSliceSampler` with the Laplace reference (its
    correctness against closed-form posteriors is tests/test_gess.py's)."""
    from pyro_subspace.cli import fit
    from pyro_subspace.infer import GeneralizedEllipticalSliceSampler

    built, make = [], fit.MCMC_KERNELS["gess"]
    monkeypatch.setitem(fit.MCMC_KERNELS, "gess", lambda m: built.append(make(m)) or built[-1])
    argv = TINY + MCMC + ["--inference", "gess", "--rank", "2", "--out", str(tmp_path)]
    assert set(cli.execute(argv)["rows"]) == {"MAP (SWA)", "PCA+GESS"}
    assert len(built) == 1 and isinstance(built[0], GeneralizedEllipticalSliceSampler)
    assert built[0].evaluations_per_draw >= 1  # it sampled: at least one evaluation per draw
