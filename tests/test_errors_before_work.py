"""Bad input found before any work, naming the argument: cases that raised a raw error after
the work (or half-way through it) before. Each check also proves no work ran."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset

from pyro_subspace import cli, datasets, distributed
from pyro_subspace.infer import run_chains


class _Stream(IterableDataset):
    def __iter__(self):
        yield from ((torch.zeros(2), torch.zeros(())) for _ in range(4))


def test_sharding_a_stream_without_a_length_names_data():
    with pytest.raises(TypeError, match="data: a _Stream without a length cannot be sharded"):
        distributed.shard(_Stream())


def test_seeds_that_overflow_for_a_later_chain_are_refused_before_the_first_runs():
    ran = []
    with pytest.raises(ValueError, match="seed: chains are seeded seed \\+ i.*<= 4294967294"):
        run_chains(ran.append, 2, seed=2**32 - 1, processes=0)
    with pytest.raises(ValueError, match="seed: "):
        run_chains(ran.append, 1, seed=-1, processes=0)
    assert ran == []  # no chain ran
    assert run_chains(lambda i: i, 2, seed=2**32 - 2, processes=0) == [0, 1]  # the last valid


def test_cli_out_that_is_a_file_is_refused_before_training(tmp_path, capsys):
    path = tmp_path / "results"
    path.write_text("not a folder")
    with pytest.raises(SystemExit):
        cli.main(["--epochs", "1", "--out", str(path)])
    err = capsys.readouterr().err
    assert "argument --out: " in err and "is an existing file, not a folder" in err
    assert path.read_text() == "not a folder"


def test_a_csv_saved_with_a_byte_order_mark_reads_its_first_column(tmp_path):
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(20, 3)).round(4)
    text = "y,a,b\n" + "".join(f"{r[0]},{r[1]},{r[2]}\n" for r in rows)
    plain, excel = tmp_path / "plain.csv", tmp_path / "excel.csv"
    plain.write_text(text, encoding="utf-8")
    excel.write_text(text, encoding="utf-8-sig")  # Excel's "CSV UTF-8" writes a BOM
    assert excel.read_bytes()[:3] == b"\xef\xbb\xbf"
    a = datasets.from_csv(plain, "y", seed=0)
    b = datasets.from_csv(excel, "y", seed=0)  # the target column was "\ufeffy" before
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)


# ------------------------------------------------------------------ ArviZ helpers


def _conjugate_export(num_samples=40):
    import pyro
    import pyro.distributions as dist
    from pyro.infer import MCMC, NUTS

    from pyro_subspace.convert import to_inference_data

    y = torch.tensor([0.3, -0.1, 0.8, 0.2])

    def model(y):
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)

    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(model), num_samples=num_samples, warmup_steps=20, disable_progbar=True)
    mcmc.run(y)
    return mcmc, model, y, to_inference_data


def test_arviz_helpers_name_what_is_wrong_before_any_work():
    from pyro_subspace.convert import tempered_loo

    mcmc, model, y, to_inference_data = _conjugate_export()
    with pytest.raises(TypeError, match="data: expected ArviZ data .*to_inference_data\\(mcmc\\)"):
        tempered_loo(mcmc)
    idata = to_inference_data(mcmc)
    with pytest.raises(ValueError, match="reff: expected a finite number > 0"):
        tempered_loo(idata, reff=0.0)
    one = to_inference_data(samples={"mu": torch.zeros(1)}, model=model, args=(y,))
    with pytest.raises(ValueError, match="data: PSIS-LOO needs at least 2 posterior draws"):
        tempered_loo(one)
    # samples of another model (another K): named before the model runs
    with pytest.raises(ValueError, match="samples\\['mu'\\]: draws of shape \\(3,\\)"):
        to_inference_data(samples={"mu": torch.zeros(5, 3)}, model=model, args=(y,))
