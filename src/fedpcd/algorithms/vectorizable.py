"""The capability to be trained by the vectorized executor (``engine.executor: vectorized``), declared apart
from the algorithm contract.

An algorithm that inherits ``Vectorizable`` and keeps the contract's ``local_update`` and ``fit`` may be
trained for many clients at once: ``begin_local`` and ``end_local`` run per client as usual, and the steps
of the shared loop run under ``torch.func.vmap`` over the clients' stacked model tensors and works (the
tensors of ``work.payload``, ``work.state`` and the working values along a leading client dimension). There
the loss is ``Vectorizable.traceable_loss`` and ``correct_grads`` is vmapped as well, so both must be
tensor code: no data-dependent Python control flow or boolean indexing, no random draws, out of place.
"""

from __future__ import annotations

from torch import Tensor, nn

from fedpcd.algorithms.contract import LocalWork


class Vectorizable:
    """Mixin: the algorithm can be trained by the vectorized executor, unless ``vectorize_blocker`` names
    a reason."""

    def vectorize_blocker(self) -> str | None:
        """Whether the vectorized executor can train this algorithm as configured.

        Returns:
            Why it cannot, or None when it can.
        """
        return None

    def traceable_loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork) -> Tensor:
        """The loss as the vectorized executor evaluates it under ``torch.func.vmap`` (``work``: one client's
        slices, nothing received): ``loss`` itself by default; a method whose ``loss`` branches on the data
        gives here its form without data-dependent branches or indexing, equal up to float rounding.

        Args:
            model: The client's model (under vmap: a functional view of the stacked weights).
            batch: `(x, y)`.
            work: One client's working values.

        Returns:
            The scalar loss.
        """
        return self.loss(model, batch, work)  # type: ignore[attr-defined]


class TwoFormLoss(Vectorizable):
    """For a loss with a data-dependent branch (boolean masks, ``if valid.any()``): ``loss`` and
    ``traceable_loss`` are ``loss_form`` with ``traceable`` False and True."""

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork) -> Tensor:
        """The contract's ``loss``: ``loss_form`` with its data-dependent branches."""
        return self.loss_form(model, batch, work, traceable=False)

    def traceable_loss(self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork) -> Tensor:
        """``loss_form`` in its masked form, for ``torch.func.vmap``."""
        return self.loss_form(model, batch, work, traceable=True)

    def loss_form(
        self, model: nn.Module, batch: tuple[Tensor, Tensor], work: LocalWork, traceable: bool
    ) -> Tensor:
        """The loss, with data-dependent branches or (``traceable``) their masked form, equal up to float
        rounding."""
        raise NotImplementedError
