"""`infer.Laplace(...)` against laplace-torch on the same MAP net (skipped without laplace-torch).

Subset of weights ∈ {last layer, subnetwork indices, all} × Hessian structure ∈ {full, diag};
predictive mean and variance of the logits, probit probabilities and the log marginal likelihood
agree to < 1e-6 relative in float64 (laplace-torch is the independent implementation).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pyro_subspace import likelihoods
from pyro_subspace.infer import Laplace

laplace = pytest.importorskip("laplace", reason="laplace-torch is a comparison, not a dependency")
pytestmark = pytest.mark.usefixtures("one_thread")


def _problem():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 10), nn.Tanh(), nn.Linear(10, 3)).double()
    x = torch.randn(60, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (60,))
    return net.eval(), x, y, torch.randn(15, 4, dtype=torch.float64)


CASES = [
    ("last_layer", "full"),
    ("last_layer", "diag"),
    ("all", "full"),
    ("all", "diag"),
    ("indices", "full"),
    ("indices", "diag"),
]


@pytest.mark.parametrize("subset,structure", CASES)
def test_matches_laplace_torch(subset, structure):
    net, x, y, x_test = _problem()
    lam = 0.7
    indices = torch.tensor([0, 3, 17, 41, 52, 60, 77, 80, 82])
    kwargs = {}
    if subset == "indices":
        kwargs = {"subnetwork_indices": indices.clone()}
    theirs = laplace.Laplace(
        net, "classification", subset_of_weights="subnetwork" if subset == "indices" else subset,
        hessian_structure=structure, prior_precision=lam, **kwargs,
    )  # fmt: skip
    theirs.fit(DataLoader(TensorDataset(x, y), batch_size=20))
    f_mu, f_var = theirs._glm_predictive_distribution(x_test)  # laplace-torch's GLM moments
    probs_theirs = theirs(x_test, pred_type="glm", link_approx="probit")
    lml_theirs = theirs.log_marginal_likelihood()

    la = Laplace(net, likelihoods.Categorical(), indices if subset == "indices" else subset,
                 structure, prior_precision=lam).fit(x, y, find_map=False)  # fmt: skip
    from pyro_subspace.infer import linearized_moments

    mean, cov = linearized_moments(la, x_test)
    probs = la.predict(x_test, link_approx="probit").probs
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max())
    assert rel(mean, f_mu.double()) < 1e-6
    their_var = f_var.double()
    ours_var = cov if their_var.dim() == 3 else cov.diagonal(dim1=-2, dim2=-1)
    assert rel(ours_var, their_var) < 1e-6
    assert rel(probs, probs_theirs.double()) < 1e-6
    lml = la.log_marginal_likelihood()
    assert abs(float(lml) - float(lml_theirs)) / abs(float(lml_theirs)) < 1e-6
