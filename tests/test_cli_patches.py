"""``pyro-subspace --inference emp|ecmp|dropout|ensemble`` on digits, tiny settings."""

import json
import math

import pytest

from pyro_subspace import cli

pytestmark = pytest.mark.usefixtures("one_thread")


TINY = ["--dataset", "digits", "--epochs", "8", "--samples", "10", "--no-progress"]


@pytest.mark.parametrize("inference", ["ecmp", "dropout"])
def test_patch_inference_prints_table_and_writes_json_and_png(inference, tmp_path, capsys):
    results = cli.execute(TINY + ["--inference", inference, "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "vanilla" in printed and inference in printed and "ECE" in printed
    assert set(results["rows"]) == {"vanilla", inference}
    for row in results["rows"].values():
        assert 0.8 < row["acc"] <= 1.0  # digits, 8 epochs: far above chance (0.1)
        assert 0 < row["nll"] < math.log(10)  # better than the uniform predictive
        assert 0 <= row["ece"] <= row["mce"] <= 1
    # overheads follow section 3.3: BN + output layer, K = 5, for the default 64-128-128-10 MLP
    d = 64 * 128 + 128 + 2 * 128 + 128 * 128 + 128 + 2 * 128 + 128 * 10 + 10
    expected = 100 * 4 * (2 * 128 * 2 + 129 * 10) / d if inference == "ecmp" else 0.0
    assert results["rows"][inference]["overhead_percent"] == pytest.approx(expected)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rows"] == results["rows"]
    png = (tmp_path / f"digits_{inference}_calibration.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_patch_inference_rejects_regression_data():
    with pytest.raises(SystemExit, match="--dataset digits"):
        cli.execute(["--inference", "emp", "--dataset", "diabetes"])
    with pytest.raises(SystemExit, match="--members"):
        cli.execute(TINY + ["--inference", "emp", "--members", "1"])
