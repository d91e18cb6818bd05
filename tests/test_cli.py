"""``pyro-subspace`` / ``pyro-subspace fit``: the subspace-inference job, parsing and help."""

import json

import pytest
import torch
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
    # the toy runs the authors' recipe: T = 1.5 in the PCA subspace
    assert results["rank"] == 10 and results["temperature"] == pytest.approx(1.5)
    assert results["recipe"] == "authors" and results["sigma_in_training"] == 1.0
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


def _resolved(argv):
    """The options ``fit`` runs with for ``argv`` (parsed, then `fit.check`ed)."""
    import importlib

    from pyro_subspace.cli import options

    args = importlib.import_module("pyro_subspace.cli.main").build_parser().parse_args(["fit", *argv])
    args.check(args, options.given_options(argv))
    return args


def test_recipe_auto_is_the_authors_code_on_toy_and_the_library_elsewhere(tmp_path):
    """``--recipe authors`` writes the settings of the authors' toy notebook into every option
    not given; a given option wins; ``library`` (and auto off toy) keeps the parser's defaults."""
    from pyro_subspace.cli import defaults

    toy = _resolved([])
    assert toy.recipe == "authors"
    for name, value in {**defaults.AUTHORS, **defaults.AUTHORS_PCA, **defaults.AUTHORS_ESS}.items():
        assert getattr(toy, name) == value, name
    assert (toy.optimizer, toy.lr, toy.momentum, toy.batch_size) == ("sgd", 1e-2, 0.95, 50)
    assert (toy.temperature, toy.prior_scale, toy.max_snapshots) == (1.5, 5.0, 10)
    # a given option wins over the recipe; outside a PCA subspace the inference keeps its own
    mine = _resolved(["--lr", "3e-3", "--temperature", "auto", "--samples", "7"])
    assert (mine.lr, mine.temperature, mine.samples, mine.swa_lr) == (3e-3, "auto", 7, 1e-2)
    nuts = _resolved(["--inference", "nuts"])  # NUTS keeps its warm-up (step-size adaptation)
    assert (nuts.samples, nuts.warmup, nuts.temperature) == (300, 200, 1.5)
    rand = _resolved(["--subspace", "random"])
    assert (rand.temperature, rand.prior_scale, rand.optimizer) == ("auto", 1.0, "sgd")
    for argv in (["--recipe", "library"], ["--dataset", "diabetes"], ["--dataset", "in_between"]):
        lib = _resolved(argv)
        assert lib.recipe == "library"
        assert (lib.optimizer, lib.lr, lib.momentum, lib.batch_size) == ("adam", 1e-3, 0.9, None)
        assert (lib.temperature, lib.prior_scale, lib.train_sigma) == ("auto", 1.0, "learn")
        assert (lib.swa_lr, lib.max_snapshots, lib.samples, lib.warmup) == (3e-4, 20, 300, 200)
    # the authors' toy inputs are (x/2, (x/2)^2) of the raw x; other data sets are untouched
    from pyro_subspace import datasets

    data = datasets.load("toy", n=20, n_test=5, n_grid=7)
    scaled = defaults.authors_inputs(toy, data)
    assert torch.allclose(scaled.x_train, datasets.toy_features(data.x_train_raw / 2))
    assert torch.allclose(scaled.grid, datasets.toy_features(data.grid_x / 2))
    assert torch.allclose(scaled.x_test, datasets.toy_features(data.x_test[:, 0] / 2))
    assert torch.equal(scaled.y_train, data.y_train)
    assert defaults.authors_inputs(_resolved(["--recipe", "library"]), data) is data
    # and the library recipe still runs T = N/K on toy: 400 points, K = 10
    results = cli.execute([*TINY, *MCMC, "--recipe", "library", "--out", str(tmp_path)])
    assert results["temperature"] == pytest.approx(40.0) and "sigma_learned_with_map" in results


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
        (["--max-iter", "50"], "--max-iter only applies to --inference laplace"),
        (["--hessian", "diag"], "--hessian only applies to --inference laplace"),
        (["--inference", "vi", "--chains", "4"], "--chains only applies to --inference ess"),
        (["--inference", "gess", "--chains", "6"], "--chains 6: gess runs two populations"),
        (["--inference", "laplace", "--hessian", "kron"], "--hessian kron needs whole layers"),
        (["--subspace", "last_layer", "--rank", "3"], "--rank only applies to --subspace pca"),
        (["--inference", "laplace", "--max-iter", "0"], "argument --max-iter: expected an integer"),
        (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
        (["--activation", "sigmoid"], "argument --activation: invalid choice: 'sigmoid'"),
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


@pytest.mark.parametrize("subspace", ["subnetwork", "ggn", "kfac"])
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
    """--inference gess runs the elliptical slice kernel with reference="auto" over 4(K + 2)
    chains in this process (its correctness against known targets is tests/test_ess_auto.py's),
    and reports convergence across its chains and populations."""
    from pyro_subspace.cli import fit
    from pyro_subspace.infer import EllipticalSliceSampler

    built, make = [], fit.MCMC_KERNELS["gess"]

    def spy(model, chains, seed):
        built.append(make(model, chains, seed))
        return built[-1]

    monkeypatch.setitem(fit.MCMC_KERNELS, "gess", spy)
    argv = TINY + MCMC + ["--inference", "gess", "--rank", "2", "--out", str(tmp_path)]
    results = cli.execute(argv)
    assert set(results["rows"]) == {"MAP (SWA)", "PCA+GESS"}
    kernel = built[0]
    assert len(built) == 1 and isinstance(kernel, EllipticalSliceSampler)
    assert kernel.reference == "auto" and kernel.chains == 16  # 4 (K + 2), K = 2
    assert kernel.evaluations_per_draw >= 1  # it sampled: at least one evaluation per draw
    mixing = results["convergence"]["PCA+GESS"]
    assert (mixing["chains"], mixing["draws"]) == (16, 12)
    # the report is the kernel's own, whose R-hat spans its two populations
    assert mixing["rhat"] == kernel.convergence.max_rhat


def test_an_unmixed_run_is_flagged_beside_its_row_and_warned(tmp_path, capsys):
    """12 draws per chain cannot give a bulk ESS of 100 per chain: the row says NOT CONVERGED,
    a ConvergenceWarning line names the problem and the command's remedies."""
    argv = TINY + MCMC + ["--rank", "2", "--out", str(tmp_path)]
    results = cli.execute(argv)
    mixing = results["convergence"]["PCA+ESS"]
    assert not mixing["ok"] and (mixing["chains"], mixing["draws"]) == (2, 12)
    assert mixing["ess_bulk"] < 200  # at most 24 draws in all
    warned = [w for w in results["warnings"] if w.startswith("ConvergenceWarning: PCA+ESS")]
    assert len(warned) == 1 and "bulk ESS" in warned[0] and "--inference gess" in warned[0]
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("PCA+ESS "))
    assert row.endswith("NOT CONVERGED") and f"{mixing['rhat']:.3f}" in row
    assert "warning: ConvergenceWarning: PCA+ESS" in out


def test_the_remedies_never_name_the_kernel_in_use():
    from pyro_subspace.cli.fit import mixing_fixes

    assert "--inference gess" in mixing_fixes("ess") and "--inference gess" in mixing_fixes("nuts")
    assert "--inference gess" not in mixing_fixes("gess") and "--warmup" in mixing_fixes("gess")


def test_a_mixed_run_has_no_warning(tmp_path, capsys):
    """Plain ESS in a 2-D random subspace at T = N/K, 2 chains x 1500 draws: R-hat <= 1.01 and
    ESS >= 100 per chain with a wide margin; no warning, no flag."""
    argv = ["--dataset", "diabetes", "--subspace", "random", "--rank", "2", "--epochs", "30",
            "--samples", "1500", "--warmup", "100", "--no-progress", "--out", str(tmp_path)]  # fmt: skip
    results = cli.execute(argv)
    mixing = results["convergence"]["RANDOM+ESS"]
    assert mixing["ok"] and mixing["rhat"] <= 1.01 and mixing["ess_bulk"] >= 200
    assert not [w for w in results["warnings"] if "ConvergenceWarning" in w]
    assert "NOT CONVERGED" not in capsys.readouterr().out



# ------------------------------------------------------------------ the noise scale, the MAP row
def test_ml_noise_scale_maximises_the_gaussian_likelihood_of_the_residuals():
    """``σ̂`` against a brute-force maximisation of ``Σ log N(y | f(x; w), σ²)`` in ``σ``."""
    import math

    import torch
    from torch import nn

    from pyro_subspace.cli.fit import ml_noise_scale

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
    x, y = torch.randn(50, 3), torch.randn(50)
    w = torch.randn(sum(p.numel() for p in net.parameters()))  # not the net's own weights
    sigma = ml_noise_scale(net, w, x, y)
    nn.utils.vector_to_parameters(w, net.parameters())
    with torch.no_grad():
        residual = y - net(x)[:, 0]
    grid = torch.linspace(0.5 * sigma, 2 * sigma, 20001, dtype=torch.float64)
    loglik = -50 * torch.log(grid) - residual.double().square().sum() / (2 * grid**2)
    assert sigma == pytest.approx(float(grid[loglik.argmax()]), rel=1e-4)
    assert sigma == pytest.approx(math.sqrt(float(residual.square().mean())), rel=1e-6)


def test_the_map_row_is_the_same_for_every_inference(tmp_path):
    """The MAP row is the network at the SWA mean with the noise scale fixed after training:
    no inference method may change it (SVI used to re-learn sigma, a Pyro parameter)."""
    import math

    argv = TINY + ["--dataset", "diabetes", "--rank", "3"]
    runs = {
        inference: cli.execute(
            [*argv, "--inference", inference, *extra, "--out", str(tmp_path / inference)]
        )
        for inference, extra in [("ess", MCMC), ("vi", ["--vi-steps", "30"]), ("laplace", [])]
    }
    maps = [r["rows"]["MAP (SWA)"] for r in runs.values()]
    sigmas = {r["sigma"] for r in runs.values()}
    assert maps[0] == maps[1] == maps[2] and len(sigmas) == 1
    # the row is scored with that sigma: a Gaussian NLL at the MAP's mean squared error
    sigma, row = sigmas.pop(), maps[0]
    nll = 0.5 * math.log(2 * math.pi * sigma**2) + row["rmse"] ** 2 / (2 * sigma**2)
    assert row["nll"] == pytest.approx(nll, rel=1e-4)
    # the jointly learned value is kept for the record, and differs
    assert runs["vi"]["sigma_learned_with_map"] != sigma


def test_toy_run_prints_the_band_width_ratio_and_no_stray_output(tmp_path, capsys):
    """The epistemic band's width at the training inputs and away from them, printed and
    saved; the progress bars are the MAP's and SWA's (no empty ``fit_map: 0it`` bar); the
    az.loo note of `to_inference_data` (the command uses tempered_loo) is not shown."""
    import warnings

    argv = ["--epochs", "30", "--swa-epochs", "12", "--samples", "12", *MCMC, "--rank", "3"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = cli.execute([*argv, "--out", str(tmp_path)])
    printed = capsys.readouterr()
    assert not [w for w in caught if "az.loo on this export" in str(w.message)]
    assert "fit_map: 0it" not in printed.err and "SWA" in printed.err
    assert "epistemic 95% band" in printed.out and "ratio" in printed.out
    train, away = results["band_width_train"], results["band_width_away"]
    assert train > 0 and results["band_width_ratio"] == pytest.approx(away / train)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["band_width_ratio"] == results["band_width_ratio"]
    # no clusters to compare with on real data
    real = [*TINY, *MCMC, "--dataset", "diabetes", "--rank", "3"]
    other = cli.execute([*real, "--out", str(tmp_path)])
    assert "band_width_ratio" not in other


def test_band_widths_against_a_direct_computation():
    import torch

    from pyro_subspace import datasets
    from pyro_subspace.cli.fit import band_widths

    data = datasets.load("toy", n=40, n_test=10, n_grid=9)  # grid -10, -7.5, ..., 10
    torch.manual_seed(0)
    f_grid, f_train = torch.randn(30, 9), 0.1 * torch.randn(30, 40)
    out = band_widths(data, f_grid, f_train)
    # outside the intervals [-7.2,-4.8], [-1.2,1.2], [4.8,7.2]: all grid points but -5, 0, 5
    away = [0, 1, 3, 5, 7, 8]
    width = 2 * 1.959963984540054
    spread_away = float(f_grid.std(0, unbiased=False)[away].mean())
    assert out["band_width_away"] == pytest.approx(width * spread_away)
    spread_train = float(f_train.std(0, unbiased=False).mean())
    assert out["band_width_train"] == pytest.approx(width * spread_train)


# ------------------------------------------------------------------ what the Laplace warning asks
def test_laplace_convergence_options_and_the_warning_names_them(tmp_path):
    """A subnetwork of a ReLU net: the MAP search stops short (its ConvergenceWarning becomes a
    table warning that names this command's options); float64 with a smooth activation
    converges without one."""
    import torch

    argv = TINY + ["--dataset", "diabetes", "--subspace", "subnetwork", "--rank", "60"]
    argv += ["--inference", "laplace", "--temperature", "1"]
    relu = cli.execute([*argv, "--max-iter", "5", "--out", str(tmp_path / "a")])
    (note,) = [w for w in relu["warnings"] if w.startswith("laplace:")]
    assert "did not converge" in note
    assert all(o in note for o in ("--dtype float64", "--max-iter", "--activation softplus"))
    smooth = cli.execute([*argv, "--dtype", "float64", "--activation", "softplus", "--out",
                          str(tmp_path / "b")])  # fmt: skip
    assert not [w for w in smooth["warnings"] if w.startswith("laplace:")]
    assert smooth["dtype"] == "float64"


def test_activation_and_dtype_build_the_network(tmp_path, monkeypatch):
    import torch

    from pyro_subspace.cli import fit

    nets = []
    real = fit.fit_map

    def spy(net, *args, **kwargs):
        nets.append(net)
        return real(net, *args, **kwargs)

    monkeypatch.setattr(fit, "fit_map", spy)
    argv = TINY + MCMC + ["--rank", "2", "--hidden", "8", "--activation", "tanh"]
    cli.execute([*argv, "--dtype", "float64", "--out", str(tmp_path)])
    net = nets[0]
    assert any(isinstance(m, torch.nn.Tanh) for m in net) and not any(
        isinstance(m, torch.nn.ReLU) for m in net
    )
    assert all(p.dtype == torch.float64 for p in net.parameters())


def test_kfac_laplace_over_whole_layers(tmp_path):
    """``--hessian kron`` (the K-FAC posterior) over the last layer: the GLM predictive keeps
    the MAP's mean (a last layer is linear in its weights) and widens its intervals; over all
    weights the subspace holds every weight."""
    argv = TINY + ["--dataset", "diabetes", "--temperature", "1", "--inference", "laplace"]
    results = cli.execute(
        argv + ["--subspace", "last_layer", "--hessian", "kron", "--out", str(tmp_path)]
    )
    rows = results["rows"]
    assert rows["LAPLACE (GLM)"]["coverage95"] >= rows["MAP (SWA)"]["coverage95"]
    assert rows["LAPLACE (GLM)"]["rmse"] == pytest.approx(rows["MAP (SWA)"]["rmse"], rel=0.05)
    every = cli.execute(argv + ["--subspace", "all", "--hessian", "kron", "--out", str(tmp_path)])
    assert every["rank"] > results["rank"] and all(r["nll"] < 10 for r in every["rows"].values())
