"""``pyro-subspace patch --inference emp|ecmp|dropout|ensemble`` on digits, tiny settings."""

import json
import math

import pytest

from pyro_subspace import cli, datasets

pytestmark = pytest.mark.usefixtures("one_thread")


TINY = ["patch", "--epochs", "8", "--samples", "10", "--no-progress"]


def _overhead(hidden: int, k: int = 5, d_in: int = 64, c: int = 10) -> float:
    """Section 3.3: (K-1) x (2 x hidden per BN layer + the output layer) / D, in percent."""
    d = d_in * hidden + hidden + 2 * hidden + hidden * hidden + hidden + 2 * hidden
    d += hidden * c + c
    return 100 * (k - 1) * (2 * hidden * 2 + (hidden + 1) * c) / d


@pytest.mark.parametrize("inference", ["ecmp", "dropout"])
def test_patch_inference_prints_table_and_writes_json_and_png(inference, tmp_path, capsys):
    results = cli.execute(TINY + ["--inference", inference, "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "vanilla" in printed and inference in printed and "ECE" in printed
    # a legend for every column, the overhead included
    for column in ("acc:", "NLL:", "ECE, MCE:", "overhead:", "train s:"):
        assert column in printed
    assert set(results["rows"]) == {"vanilla", inference}
    for row in results["rows"].values():
        assert 0.8 < row["acc"] <= 1.0  # digits, 8 epochs: far above chance (0.1)
        assert 0 < row["nll"] < math.log(10)  # better than the uniform predictive
        assert 0 <= row["ece"] <= row["mce"] <= 1
    # overheads follow section 3.3: BN + output layer, K = 5, for the default 64-128-128-10 MLP
    expected = _overhead(128) if inference == "ecmp" else 0.0
    assert results["rows"][inference]["overhead_percent"] == pytest.approx(expected)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rows"] == results["rows"]
    png = (tmp_path / f"digits_{inference}_calibration.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_hidden_and_components_set_the_architecture(tmp_path):
    argv = ["--inference", "emp", "--hidden", "32,32", "--components", "3", "--epochs", "2"]
    results = cli.execute(TINY + argv + ["--out", str(tmp_path)])
    assert results["components"] == 3
    assert results["rows"]["emp"]["overhead_percent"] == pytest.approx(_overhead(32, k=3))


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--dataset", "diabetes"], "argument --dataset: invalid choice: 'diabetes'"),
        (["--components", "1"], "argument --components: expected an integer >= 2"),
        (["--inference", "dropout", "--components", "3"], "--components only applies to"),
        (["--drop-prob", "0.2"], "--drop-prob only applies to --inference dropout"),
        (["--epochs", "0"], "--epochs: expected a positive int"),
        (["--prior-scale", "2"], "unrecognized arguments: --prior-scale"),
        (["--hidden", "128,0"], "argument --hidden: expected widths like 200,50"),
    ],
)
def test_bad_patch_options_exit_with_a_message(argv, match, usage_error):
    assert match in usage_error(["patch", *argv])


def _csv(path, n: int, classes: int = 3, seed: int = 0) -> str:
    """A CSV of ``n`` rows, three features and a label column ``y`` cycling over ``classes``."""
    import numpy as np

    rows = np.random.default_rng(seed).normal(size=(n, 3)).round(4)
    lines = ["y,a,b,c"] + [f"{i % classes},{r[0]},{r[1]},{r[2]}" for i, r in enumerate(rows)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize(
    "n, classes, match",
    [
        (40, 3, "40 rows give a test split of 4 points; the report's ECE and MCE count the "
                "confidence bins of more than 5 test points"),
        (30, 1, "--target y holds 1 class; a classifier needs at least 2"),
    ],
)  # fmt: skip
def test_a_csv_too_small_for_the_report_is_a_usage_error_before_training(
    n, classes, match, tmp_path, usage_error, monkeypatch
):
    """A CSV whose test split holds at most 5 points (no calibration bin the report counts)
    or whose target has one class: a usage error naming the data's size, before any training
    (a traceback after training before)."""
    from pyro_subspace.cli import patch

    trained = []
    monkeypatch.setattr(patch, "_train", lambda *a: trained.append(a) or 1 / 0)
    path = _csv(tmp_path / "small.csv", n, classes)
    argv = ["--dataset", "csv", "--csv", path, "--target", "y", "--out", str(tmp_path / "out")]
    err = usage_error(TINY + argv)
    assert f"--csv {path}: {match}" in err
    assert "Traceback" not in err and trained == []


def test_calibration_errors_the_test_split_cannot_give_are_reported_as_missing(
    tmp_path, capsys, monkeypatch
):
    """Six test points whose confidences fall in six different bins: ECE and MCE do not exist
    (no bin of more than 5 points); the trained models are still scored and written, ECE and
    MCE ``null`` in the JSON, ``n/a`` in the table, and a warning says why."""
    import torch

    from pyro_subspace.cli import patch

    conf = torch.tensor([0.4, 0.5, 0.6, 0.7, 0.8, 0.9], dtype=torch.float64)
    spread = torch.stack([conf, (1 - conf) / 2, (1 - conf) / 2], 1)
    monkeypatch.setattr(patch, "_probs", lambda model, x, s: spread[: len(x)])
    path = _csv(tmp_path / "sixty.csv", 60)
    argv = ["--dataset", "csv", "--csv", path, "--target", "y", "--epochs", "1"]
    results = cli.execute(TINY + argv + ["--out", str(tmp_path)])
    printed = capsys.readouterr().out
    y = datasets.from_csv(path, "y", task="classification", seed=0).y_test  # the same split
    assert len(y) == 6
    for name, row in results["rows"].items():
        assert row["ece"] is None and row["mce"] is None
        assert row["acc"] == pytest.approx(float((y == 0).double().mean()))  # argmax: class 0
        assert row["nll"] == pytest.approx(float(-spread[torch.arange(6), y].log().mean()))
        assert f"warning: {name}: ECE and MCE are n/a: none of the 20 confidence bins holds " \
               f"more than 5 of the 6 test points" in printed  # fmt: skip
    assert printed.count("n/a") >= 4
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rows"]["vanilla"]["ece"] is None
