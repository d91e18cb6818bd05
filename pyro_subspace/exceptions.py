"""The library's own warning and error classes (catch or filter them by type)."""

from __future__ import annotations


class ConvergenceWarning(UserWarning):
    """An iterative solver stopped before reaching its stated tolerance.

    Raised as a warning (``warnings.warn``), never an error: the result is returned, and the
    message says what was reached and how to get convergence. Turn it into an error with
    ``warnings.simplefilter("error", ConvergenceWarning)``.
    """


class TrainingDivergedError(FloatingPointError):
    """A training loop met a non-finite loss or output.

    Attributes:
        epoch: the epoch (counted from 1) in which the loss or the outputs became non-finite.
        restored_epoch: the epoch whose weights the network was given back (0: the weights
            it had before training), or ``None`` when the loop did not restore anything.
    """

    def __init__(self, message: str, epoch: int, restored_epoch: int | None = None) -> None:
        super().__init__(message)
        self.epoch = epoch
        self.restored_epoch = restored_epoch


class UnsupportedModelError(ValueError, TypeError):
    """A model that a kernel cannot sample as it is written (elliptical slice sampling: a latent
    whose prior is not a fixed Gaussian, or whose log-density a handler such as
    ``poutine.scale`` or ``poutine.mask`` changes).

    A ``ValueError``, as Pyro's MCMC kernels raise for invalid models, and a ``TypeError``, as
    this library raised for them before: ``except`` clauses for either keep working. The message
    names the site.
    """


class SubsamplingError(ValueError, NotImplementedError):
    """An inference method that needs the full-data likelihood was given a subsampled model
    (a plate with ``subsample_size`` or ``subsample``, or a ``subsample_size`` argument).

    A ``NotImplementedError`` (so a ``RuntimeError``), as Pyro's MCMC kernels raise for
    subsampled models, and a ``ValueError``, as this library raised for them before. The
    message names the plate or the argument and says "subsample".
    """
