"""``pyro-subspace patch --inference emp|ecmp|dropout|ensemble`` on digits, tiny settings."""

import json
import math

import pytest

from pyro_subspace import cli

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
