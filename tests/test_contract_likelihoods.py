"""Every likelihood runs `contracts.likelihood.BaseLikelihoodTestCase`."""

import pytest
import torch
from contracts.likelihood import BaseLikelihoodTestCase

from pyro_subspace import likelihoods

pytestmark = pytest.mark.usefixtures("one_thread")


class TestGaussian(BaseLikelihoodTestCase):
    def create_likelihood(self):
        return likelihoods.Gaussian(sigma=0.7)


class TestGaussianLearnedSigma(BaseLikelihoodTestCase):
    def create_likelihood(self):
        return likelihoods.Gaussian(sigma_init=1.3)


class TestGaussianMultiOutput(BaseLikelihoodTestCase):
    num_outputs = 2

    def create_likelihood(self):
        return likelihoods.Gaussian(sigma=torch.tensor([0.5, 2.0], dtype=torch.float64))


class TestGaussianHeteroscedastic(BaseLikelihoodTestCase):
    """The output Hessian is the Fisher; the predictive's noise is ``s(x)²`` at the mean
    outputs, exact when the scale column has no variance (the moments here give it none)."""

    num_outputs = 2
    hessian_is_expected = True

    def create_likelihood(self):
        return likelihoods.Gaussian(heteroscedastic=True)

    def moments(self, seed: int = 2):
        m, c = super().moments(seed)
        c[:, 1, :] = 0
        c[:, :, 1] = 0
        return m, c


class TestGaussianHeteroscedasticGlobalVariance(TestGaussianHeteroscedastic):
    """Subspace Inference G.1.1: ``σ²(x) = s² + softplus(raw)`` with a learned ``s²``."""

    def create_likelihood(self):
        return likelihoods.Gaussian(heteroscedastic=True, global_variance=True, sigma_init=0.8)


class TestCategorical(BaseLikelihoodTestCase):
    num_outputs = 3

    def create_likelihood(self):
        return likelihoods.Categorical()


class TestBernoulli(BaseLikelihoodTestCase):
    def create_likelihood(self):
        return likelihoods.Bernoulli()
