"""laplace-torch's documented patterns run unchanged on both libraries: agreement table.

For each pattern of laplace-torch's README and documentation, the same lines run against
laplace-torch (float64, its default backend) and against `pyro_subspace.infer.Laplace` on the
same MAP nets (those of ``tests/test_laplace_torch_compat.py``), and against the dense
computation by autograd; the table gives the largest difference relative to the largest entry.

Run: ``python benchmarks/laplace_torch_patterns.py`` (needs laplace-torch; a few seconds).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
warnings.filterwarnings("ignore")
torch.set_num_threads(1)

from test_laplace_torch_compat import (  # noqa: E402
    F64, classification_problem, regression_evidence, regression_posterior, regression_problem,
)

from pyro_subspace import likelihoods  # noqa: E402
from pyro_subspace.infer import Laplace  # noqa: E402


def rel(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return float((a - b).abs().max() / b.abs().max())


def main() -> int:
    import laplace as lt

    rows = []
    net, x, y = regression_problem()
    loader = DataLoader(TensorDataset(x, y), batch_size=40)
    gauss = lambda: likelihoods.Gaussian(torch.tensor(0.2, dtype=F64))  # noqa: E731
    th = lt.Laplace(net, "regression", subset_of_weights="all", hessian_structure="full",
                    sigma_noise=0.2, prior_precision=0.5)  # fmt: skip
    th.fit(loader)
    ours = Laplace(net, gauss(), "all", "full", prior_precision=0.5).fit(loader)
    _, jac, cov, _ = regression_posterior(net, x, 0.5, 0.2)
    dense = torch.einsum("nok,kj,npj->nop", jac[:6], cov, jac[:6])
    (mo, vo), (mt, vt) = ours(x[:6]), th(x[:6])
    rows.append(("regression, all, full: fit(loader); f_mu, f_var = la(x)", "unchanged",
                 f"f_mu {rel(mo, mt):.1e}, f_var {rel(vo, vt):.1e} (ours-dense {rel(vo, dense):.0e}, "
                 f"theirs-dense {rel(vt, dense):.1e})"))  # fmt: skip
    ev = regression_evidence(net, x, y, 0.5, 0.2)
    rows.append(("log_marginal_likelihood()", "unchanged",
                 f"{rel(ours.log_marginal_likelihood(), th.log_marginal_likelihood()):.1e} "
                 f"(ours-dense {rel(ours.log_marginal_likelihood(), ev):.0e})"))  # fmt: skip
    # the README hyperparameter loop, on both
    finals = []
    for la in (Laplace(net, likelihoods.Gaussian(torch.tensor(1.0, dtype=F64)), "all", "full"),
               lt.Laplace(net, "regression", subset_of_weights="all", hessian_structure="full")):  # fmt: skip
        la.fit(loader)
        log_prior, log_sigma = torch.ones(1, requires_grad=True), torch.ones(1, requires_grad=True)
        opt = torch.optim.Adam([log_prior, log_sigma], lr=1e-1)
        for _ in range(100):
            opt.zero_grad()
            (-la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())).backward()
            opt.step()
        finals.append((float(la.prior_precision), float(la.sigma_noise), la(x[:6])[1]))
    (lo, so, vo), (lt_, st, vt) = finals
    rows.append(("README loop: log_marginal_likelihood(λ, σ) + Adam, then la(x)", "unchanged",
                 f"λ {abs(lo - lt_) / lt_:.1e}, σ {abs(so - st) / st:.1e}, f_var after {rel(vo, vt):.1e}"))  # fmt: skip
    net, x, y = classification_problem()
    loader = DataLoader(TensorDataset(x, y), batch_size=60)
    th = lt.Laplace(net, "classification", subset_of_weights="last_layer", hessian_structure="full",
                    prior_precision=2.0)  # fmt: skip
    th.fit(loader)
    ours = Laplace(net, likelihoods.Categorical(), "last_layer", "full", prior_precision=2.0).fit(loader)
    for link in ("probit", "bridge", "bridge_norm"):
        rows.append((f"classification, last layer: la(x, link_approx='{link}')", "unchanged",
                     f"{rel(ours(x[:8], link_approx=link), th(x[:8], link_approx=link)):.1e}"))  # fmt: skip
    th.optimize_prior_precision(method="marglik", pred_type="glm", link_approx="probit")
    ours.optimize_prior_precision(method="marglik", pred_type="glm", link_approx="probit")
    rows.append(("optimize_prior_precision(method='marglik', pred_type=, link_approx=)", "unchanged",
                 f"λ {abs(float(ours.prior_precision) - float(th.prior_precision)) / float(th.prior_precision):.1e} "
                 "(ours: L-BFGS to the optimum; theirs: 100 Adam steps)"))  # fmt: skip
    xv, yv = x[40:], y[40:]
    val = DataLoader(TensorDataset(xv, yv), batch_size=7)
    th2 = lt.Laplace(net, "classification", subset_of_weights="last_layer", hessian_structure="full")
    th2.fit(loader)
    th2.optimize_prior_precision(method="gridsearch", val_loader=val, log_prior_prec_min=-2,
                                 log_prior_prec_max=2, grid_size=9, link_approx="probit")  # fmt: skip
    ours2 = Laplace(net, likelihoods.Categorical(), "last_layer", "full").fit(loader)
    ours2.optimize_prior_precision(method="gridsearch", val_loader=val, log_prior_prec_min=-2,
                                   log_prior_prec_max=2, grid_size=9, link_approx="probit")  # fmt: skip
    rows.append(("gridsearch with val_loader, log_prior_prec_min/max, grid_size", "unchanged",
                 f"λ ours {float(ours2.prior_precision):.4g}, theirs {float(th2.prior_precision):.4g}"))  # fmt: skip
    net, x, y = regression_problem()
    th = lt.Laplace(net, "regression", subset_of_weights="all", hessian_structure="full", sigma_noise=0.2)
    th.fit(DataLoader(TensorDataset(x, y), batch_size=40))
    ours = Laplace(net, gauss(), "all", "full").fit(x, y)
    lam = torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=F64)
    th.prior_precision, ours.prior_precision = lam, lam
    rows.append(("layerwise prior: la.prior_precision = (one per tensor); evidence, la(x)", "unchanged",
                 f"evidence {rel(ours.log_marginal_likelihood(), th.log_marginal_likelihood()):.1e}, "
                 f"f_var {rel(ours(x[:5])[1], th(x[:5])[1]):.1e}"))  # fmt: skip
    rows.append(("predictive_samples(x, pred_type='glm'|'nn', n_samples)", "unchanged",
                 f"shapes {tuple(ours.predictive_samples(x[:3], n_samples=5).shape)} = "
                 f"{tuple(th.predictive_samples(x[:3], n_samples=5).shape)}; moments: tests"))  # fmt: skip
    rows.append(("sample(n_samples)", "unchanged",
                 f"shapes {tuple(ours.sample(4).shape)} = {tuple(th.sample(4).shape)}"))  # fmt: skip
    rows.append(("state_dict / load_state_dict", "unchanged", "bit-identical predictions (tests)"))
    rows.append(("Laplace(net, 'regression', sigma_noise=...) (string likelihood)",
                 "refused with guidance", "the error names likelihoods.Gaussian(sigma=...)"))  # fmt: skip
    net, x, y = classification_problem()
    loader = DataLoader(TensorDataset(x, y), batch_size=60)
    th = lt.Laplace(net, "classification")  # its defaults: last layer, K-FAC (kron), GGN
    th.fit(loader)
    ours = Laplace(net, likelihoods.Categorical()).fit(loader)  # ours: the same defaults
    rows.append(("Laplace(net, likelihood) defaults (last layer, kron); la(x), evidence", "unchanged",
                 f"probit {rel(ours(x[:8]), th(x[:8])):.1e}, evidence "
                 f"{rel(ours.log_marginal_likelihood(), th.log_marginal_likelihood()):.1e}"))  # fmt: skip
    rows.append(("optimize_prior_precision(loss=custom)", "refused with guidance", "the NLL grid"))
    rows.append(("la(x, joint=True); fit(override=False)", "refused with guidance", "not supported"))
    rows.append(("backend=BackPackGGN / CurvlinopsGGN", "not applicable",
                 "one exact GGN by Jacobian products"))  # fmt: skip
    width = max(len(r[0]) for r in rows)
    print(f"{'pattern':<{width}}  {'status':<22}  agreement (max |ours - theirs| / max |theirs|)")
    for pattern, status, agreement in rows:
        print(f"{pattern:<{width}}  {status:<22}  {agreement}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
