"""Posterior buffers that a Laplace fit may leave to first use.

With fewer GGN rows ``r = N·C`` than weights ``K``, the covariance comes from the rows
themselves by Woodbury's identity (`FullStructure.posterior_from_root_`); the ``(K, K)`` GGN
``AᵀA``, the precision ``AᵀA/T + Λ₀`` and the factor ``L = chol(Σ)`` are then not needed for
the linearised predictive, and each costs ``K²r/2`` to ``K³/3`` multiplications. `fit` leaves
them pending: reading ``guide.ggn``, ``guide.precision`` or ``guide.scale_tril`` (a draw, the
evidence, a ``state_dict``) forms it then, from the kept rows, exactly as the fit would have.
"""

from __future__ import annotations

import torch

from ...curvature.gram import RootRows, gram_from_blocks

#: The buffers a fit from rows may leave to first use.
DEFERRABLE = ("ggn", "precision", "scale_tril")


class Deferred:
    """A buffer of a `DeferredPosterior` that reading forms, if the fit left it pending."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        if self.name not in obj.__dict__.get("_buffers", {}):  # during construction
            raise AttributeError(self.name)
        if self.name in obj.__dict__.get("_pending", ()):
            obj._form(self.name)
        return obj._buffers[self.name]


class DeferredPosterior:
    """Mixin of `AutoSubspaceLaplace`: the pending buffers, the kept GGN rows and their
    validity, and a ``state_dict`` that always holds every buffer formed."""

    ggn = Deferred()
    precision = Deferred()
    scale_tril = Deferred()

    def _reset_deferred(self, rows: RootRows | None = None, lam: torch.Tensor | None = None):
        """Forget pending buffers; keep ``rows`` (the GGN's root, collected by a fit whose GGN
        is then pending) and the ``λ`` of a pending precision."""
        self.__dict__["_pending"] = set()
        self.__dict__["_rows"] = rows
        self.__dict__["_rows_ggn"] = None  # (the ggn buffer formed from the rows, its version)
        self.__dict__["_pending_lam"] = lam
        if rows is not None:
            self.__dict__["_pending"].add("ggn")

    def _root(self) -> torch.Tensor | None:
        """The GGN's root ``A`` ``(r, K)`` if it still matches the ``ggn`` buffer, else ``None``
        (a re-tuned curvature, a loaded state, a guide moved to another device)."""
        rows = self.__dict__.get("_rows")
        if rows is None or rows.parts[0].device != self.loc.device:  # moved by ``.to``
            return None
        if "ggn" not in self.__dict__["_pending"]:
            formed = self.__dict__.get("_rows_ggn")
            ggn = self._buffers["ggn"]
            if formed is None or formed[0] is not ggn or formed[1] != ggn._version:
                return None
        return rows.matrix()

    def _defer(self, *names: str, lam: torch.Tensor | None = None) -> None:
        self.__dict__["_pending"].update(names)
        if lam is not None:
            self.__dict__["_pending_lam"] = lam

    def _form(self, name: str) -> None:
        """Write the pending buffer ``name`` (and what it needs) into the buffer."""
        out = self._materialized(name)
        if name == "ggn":  # Σ AᵀA over the kept blocks, as the fit's `gram_from_blocks`
            blocks = ((None, part) for part in self.__dict__["_rows"].parts)
            out.copy_(gram_from_blocks(blocks, dtype=out.dtype))
            self.__dict__["_rows_ggn"] = (self._buffers["ggn"], self._buffers["ggn"]._version)
        elif name == "precision":
            lam = self.__dict__["_pending_lam"]
            self.structure._precision_(self.ggn, self.temperature, lam, self.model, out)
        else:
            self.structure.factor_from_covariance_(self.covariance, out)
        self.__dict__["_pending"].discard(name)  # only once written (an error leaves it pending)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        for name in DEFERRABLE:  # the state holds all of the posterior
            getattr(self, name)
        super()._save_to_state_dict(destination, prefix, keep_vars)
