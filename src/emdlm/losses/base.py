"""The loss contract: what every emdlm loss is and declares, so that no caller has to probe.

Like torchtune's ``SFTLoss`` protocol, every objective is an :class:`EMDLMLoss` (an
``nn.Module``) that *declares* what it needs from a training loop in class attributes, and the
integrations (:mod:`emdlm.integrations.loss_step`) read those declarations instead of trying
attributes or signatures:

==========================  =====================================================================
``needs_teacher``           ``forward(logits, labels, teacher_logits)``: distils from a frozen
                            teacher's logits of the same inputs (shifted like the student's).
``takes_number_mask``       ``forward(..., number_mask=m)`` and ``from_hidden(..., number_mask=m)``
                            accept a bool mask aligned with ``labels``: which tokens may be scored
                            as numbers (``data.number_scope``).
``has_from_hidden``         ``from_hidden(hidden, lm_head_weight, labels, lm_head_bias=None, *,
                            logit_scale=None, softcap=None, ...)``: the same loss from the final
                            hidden state and the output embedding, never building [N, V] logits.
``hidden_transforms``       the logit transforms ``from_hidden`` takes (every emdlm loss: both).
``reduction``, ``ignore_index``  set per instance: ``"mean"`` over scored tokens or ``"sum"``
                            (what a framework that divides by the token count needs).
==========================  =====================================================================

Every loss returns a :class:`~emdlm._output.LossOutput` (``loss`` and ``components``).
:mod:`emdlm.objective_specs` registers each objective by name; tests/test_conformance.py runs
one suite over every registered objective (equal paths, padding, reduction, gradient
accumulation, compile), so a new objective is tested everywhere by being registered.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from emdlm._output import LossOutput

#: The logit transforms a ``from_hidden`` may be asked to apply (see
#: :class:`emdlm.integrations.hidden_forward.OutputHead`): every emdlm loss takes both.
HIDDEN_TRANSFORMS: tuple[str, ...] = ("logit_scale", "softcap")


class EMDLMLoss(nn.Module):
    """Base class of every emdlm loss: the declarations above, with their defaults.

    A subclass sets ``reduction`` and ``ignore_index`` in ``__init__``, implements ``forward``
    and, when ``has_from_hidden`` (the default), ``from_hidden``.
    """

    needs_teacher: ClassVar[bool] = False
    takes_number_mask: ClassVar[bool] = False
    has_from_hidden: ClassVar[bool] = True
    hidden_transforms: ClassVar[tuple[str, ...]] = HIDDEN_TRANSFORMS

    reduction: str
    ignore_index: int

    def forward(self, logits: Any, labels: Any, *args: Any, **kwargs: Any) -> LossOutput:
        raise NotImplementedError(f"{type(self).__name__} implements no forward")

    def from_hidden(self, *args: Any, **kwargs: Any) -> LossOutput:
        """Overridden by every loss with ``has_from_hidden``; the others refuse by name."""
        raise NotImplementedError(
            f"{type(self).__name__} has no from-hidden path (has_from_hidden is False): use the "
            "logits path (from_hidden=False, train.fused_linear: false)"
        )


__all__ = ["HIDDEN_TRANSFORMS", "EMDLMLoss"]
