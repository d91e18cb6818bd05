"""Bad input found before any work, naming the argument: cases that raised a raw error after
the work (or half-way through it) before. Each check also proves no work ran."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from pyro_subspace import cli, curvature, datasets, distributed, subspaces
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


# ------------------------------------------------------------------ tuning the prior precision


class _CountingRows(torch.utils.data.Dataset):
    """Validation data that counts its reads."""

    def __init__(self, x, y):
        self.x, self.y, self.reads = x, y, 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.reads += 1
        return self.x[i], self.y[i]


def _fitted_laplace():
    from pyro_subspace import SubspaceNet, likelihoods, subspaces
    from pyro_subspace.infer import AutoSubspaceLaplace

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x = torch.randn(30, 2, dtype=torch.float64)
    y = torch.randint(0, 3, (30,))
    model = SubspaceNet(net, subspaces.random(net, 3, seed=0), likelihoods.Categorical())
    return AutoSubspaceLaplace(model, prior_precision=2.0).fit(x, y), x, y


BAD_TUNING = [
    ({"method": "grid", "grid": "abc"}, TypeError, "grid: .*got str 'abc'"),
    ({"method": "grid", "grid": [1.0, "a"]}, TypeError, "grid: .*not an array of numbers"),
    ({"method": "grid", "grid": [[1.0, 2.0], [3.0]]}, TypeError, "grid: .*not an array"),
    ({"method": "grid", "grid": {"a": 1.0}}, TypeError, "grid: .*got dict"),
    ({"method": "grid", "grid": [True, False]}, TypeError, "grid: .*torch.bool"),
    ({"method": "grid", "grid": torch.tensor([1 + 1j])}, TypeError, "grid: .*complex"),
    ({"method": "grid", "grid": [1.0, 0.0]}, ValueError, "grid: expected positive finite"),
    ({"method": "marglik", "groups": "abc"}, TypeError, "groups: .*integer labels"),
    ({"method": "marglik", "groups": [0.5, 1.5, 0.2]}, TypeError, "groups: .*float"),
    ({"method": "marglik", "groups": [True, False, True]}, TypeError, "groups: .*bool"),
    ({"method": "marglik", "groups": [0, 1]}, ValueError, "groups: .*\\(3,\\).*shape \\(2,\\)"),
    ({"method": "marglik", "adam": "abc"}, TypeError, "adam: expected \\(n_steps, lr\\)"),
    ({"method": "marglik", "adam": (10,)}, TypeError, "adam: "),
    ({"method": "marglik", "adam": (10, "x")}, TypeError, "adam: .*lr='x'"),
    ({"method": "marglik", "adam": (2.5, 0.1)}, TypeError, "adam: .*n_steps=2.5"),
    ({"method": "marglik", "adam": (0, 0.1)}, ValueError, "adam: "),
    ({"method": "marglik", "adam": (10, -1.0)}, ValueError, "adam: "),
    ({"method": "marglik", "adam": (10, float("nan"))}, ValueError, "adam: "),
]


@pytest.mark.parametrize(
    "kwargs, error, match", BAD_TUNING, ids=[str(k) for k, _, _ in BAD_TUNING]
)
def test_tuning_arguments_are_named_before_the_data_is_read_or_the_evidence_computed(
    kwargs, error, match, monkeypatch
):
    """``optimize_prior_precision``'s grid (torch's ``new(): invalid data type 'str'`` before),
    groups (floats were truncated to labels) and Adam schedule (Python's unpacking errors):
    named, with what to give, before the validation data is read or the evidence computed."""
    guide, x, y = _fitted_laplace()
    before = guide.prior_precision.clone()
    evidence = []
    monkeypatch.setattr(
        guide, "log_marginal_likelihood", lambda *a, **k: evidence.append(1) or 1 / 0
    )
    data = _CountingRows(x, y)
    if kwargs["method"] == "grid":
        kwargs = {**kwargs, "x_val": DataLoader(data, batch_size=10)}
    with pytest.raises(error, match=f"^{match}"):
        guide.optimize_prior_precision(**kwargs)
    assert data.reads == 0 and evidence == []
    assert torch.equal(guide.prior_precision, before)


def test_the_grid_through_laplace_torch_s_door_is_named():
    """``infer.Laplace(...).optimize_prior_precision(method="gridsearch", grid="abc")``: the
    same ``TypeError`` naming ``grid``, before the validation loader is read."""
    from pyro_subspace import infer

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randn(20, 2, dtype=torch.float64)
    y = torch.randint(0, 3, (20,))
    la = infer.Laplace(net, "classification", subset_of_weights="all", hessian_structure="diag")
    la.fit(DataLoader(TensorDataset(x, y), batch_size=10))
    data = _CountingRows(x, y)
    with pytest.raises(TypeError, match="^grid: .*got str 'abc'"):
        la.optimize_prior_precision(
            method="gridsearch", grid="abc", val_loader=DataLoader(data, batch_size=10)
        )
    assert data.reads == 0


# ------------------------------------------------------------------ curvature at broken weights


class _Masked(nn.Module):
    """A classifier with a BatchNorm and a ``-inf`` mask buffer (an attention mask's kind of
    inf: legitimate), its first layer optionally frozen."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Tanh()).double()
        self.head = nn.Linear(4, 3).double()
        self.register_buffer("mask", torch.tensor([0.0, 0.0, float("-inf")], dtype=torch.float64))

    def forward(self, x):
        logits = self.head(self.body(x))
        return torch.where(torch.isinf(self.mask), logits.new_zeros(()), logits)


def _break(net, where):
    with torch.no_grad():
        if where == "weight":
            net.head.weight[1, 2] = float("nan")
        elif where == "frozen":
            net.body[0].requires_grad_(False)
            net.body[0].bias[3] = float("inf")
        elif where == "buffer":
            net.body[1].running_var[0] = float("nan")
        elif where == "running_mean_inf":
            net.body[1].running_mean[2] = float("inf")


CURVATURE_PASSES = {
    "kfac": lambda net, lik, x, w: curvature.kfac(net, lik, x),
    "ggn_eigen": lambda net, lik, x, w: subspaces.ggn_eigen(net, lik, x, 2, w=w),
    "kfac_eigen": lambda net, lik, x, w: subspaces.kfac_eigen(net, lik, x, 2, w=w),
    # every entry point of curvature.ggn shares the check (its `_setup`)
    "ggn_diagonal": lambda net, lik, x, w: curvature.ggn_diagonal(net, lik, x, w=w),
    "ggn_vector_product": lambda net, lik, x, w: curvature.ggn_vector_product(
        net, lik, x, torch.ones(sum(p.numel() for p in net.parameters() if p.requires_grad), dtype=torch.float64), w=w
    ),
}


@pytest.mark.parametrize("entry", list(CURVATURE_PASSES))
@pytest.mark.parametrize(
    "where, match",
    [
        ("weight", "^net: its weights contain NaN or inf \\(parameter 'head.weight', entry "
                   "\\(1, 2\\): nan\\)"),
        ("frozen", "^net: its weights contain NaN or inf \\(parameter 'body.0.bias', entry "
                   "\\(3,\\): inf\\)"),
        ("buffer", "^net: buffer 'body.1.running_var' contains NaN"),
        ("running_mean_inf", "^net: buffer 'body.1.running_mean' contains inf"),
        ("w", "^w: contains NaN or inf \\(inf at row 5\\)"),
    ],
)  # fmt: skip
def test_curvature_at_non_finite_weights_names_them_before_a_forward_pass(entry, where, match):
    """K-FAC and ``ggn_eigen`` at a network with a NaN/inf weight (trainable or frozen), a NaN
    BatchNorm statistic, or a given ``w`` with an inf: named before any forward pass (a
    forward pass ran, then ``outputs: contains NaN or inf`` was raised). A ``-inf`` mask
    buffer is legitimate: the same network without the damage runs."""
    from pyro_subspace import likelihoods
    from pyro_subspace.flat import FlatNet

    net = _Masked().eval()
    x = torch.randn(10, 2, dtype=torch.float64)
    lik = likelihoods.Categorical()
    run = CURVATURE_PASSES[entry]
    assert run(net, lik, x, None) is not None  # the -inf mask is not an error
    w = None
    if where == "w":
        if entry == "kfac":
            pytest.skip("kfac takes no w: it reads the network's own weights")
        w = FlatNet(net).vector().clone()
        w[5] = float("inf")
    else:
        _break(net, where)
    passes = []
    net.register_forward_hook(lambda *a: passes.append(1))
    with pytest.raises(ValueError, match=match):
        run(net, lik, x, w)
    assert passes == []
