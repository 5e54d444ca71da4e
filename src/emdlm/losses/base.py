"""The loss contract: what every emdlm loss is and declares, so that no caller has to probe.

Like torchtune's ``SFTLoss`` protocol, every objective is an :class:`EMDLMLoss` (an
``nn.Module``) that *declares* what it needs from a training loop in class attributes, and the
integrations (:mod:`emdlm.integrations.loss_contract`, used by
:class:`emdlm.integrations.transformers.ComputeLoss`) read those declarations instead of trying
attributes or signatures. Every loss is called one way, on both routes::

    loss(logits, labels, *, number_mask=None, teacher_logits=None, loss_weights=None)
    loss.from_hidden(hidden, lm_head_weight, labels, lm_head_bias=None, *, number_mask=None,
                     teacher_logits=None, loss_weights=None, logit_scale=None, softcap=None,
                     chunk_size=None)

==========================  =====================================================================
``needs_teacher``           ``teacher_logits=`` is required: the loss distils from a frozen
                            teacher's logits of the same inputs (shifted like the student's);
                            a loss that does not declare it refuses them.
``takes_number_mask``       ``number_mask=`` may be a bool mask aligned with ``labels``: which
                            tokens may be scored as numbers (``data.number_scope``); a loss that
                            does not declare it refuses a mask.
``takes_loss_weights``      ``loss_weights=`` may be per-token weights (below); a loss that does
                            not declare it refuses them (NotImplementedError naming it).
``has_from_hidden``         ``from_hidden``: the same loss from the final hidden state and the
                            output embedding, never building [N, V] logits (given once, here, on
                            the loss's ``chunk_objective``).
``hidden_transforms``       the logit transforms ``from_hidden`` takes (every emdlm loss: both).
``reduction``, ``ignore_index``  set per instance: ``"mean"`` over scored tokens or ``"sum"``
                            (what a framework that divides by the token count needs).
==========================  =====================================================================

``loss_weights`` (per-token weights w, a floating-point tensor of the labels' shape, finite
and ≥ 0) is taken by the losses that declare ``takes_loss_weights`` (the weighted-CE family
CE, DFT, MixCE, TaiLr; EMO, EMO distillation and the KL distillation baseline; NTIL, digit
EMD and the NTL losses, whose number-level terms weigh each number by its tokens' mean
weight); any other raises
NotImplementedError naming itself (:meth:`EMDLMLoss.check_call`), never silently ignoring
them. Over the counted tokens C (labels
not ``ignore_index``), with l_t the loss's own per-token term::

    "sum":  Σ_{t∈C} w_t·l_t          "mean":  Σ_{t∈C} w_t·l_t / Σ_{t∈C} w_t   (0 when Σ w = 0)

and the components (``ce``, ``token_accuracy``, ...) are the same weighted means, with
``n_tokens`` = Σ_{t∈C} w_t: a weight of 0 scores a token exactly as an ignored label (loss and
gradient), weights of 1 are the unweighted loss. Tokens of weight 0 are set to
``ignore_index`` before the loss reads its labels (:func:`drop_zero_weights`, on device), so
inside a number the number ends there, exactly as at an ignored label. ntloss's
``loss_weights`` (AI4SD/number-token-loss, ``ntloss/core.py``) is the same weighted mean,
Σ w·l / max(Σ w, eps), but over its number tokens only (:mod:`emdlm.losses.ntl` says where
the NTL losses differ from it); Liger-Kernel has no per-token weights
(https://github.com/linkedin/Liger-Kernel/issues/338, open), only torch's per-class ``weight``
(``ce_weight``: Σ w_{y_t}·l_t / Σ w_{y_t}).
Both routes run the same chunk objective (:mod:`emdlm.ops.chunked`), the weights'
value check folded into its one host sync. A trainer's ``num_items_in_batch`` counts labels,
not weights: a caller that weights tokens and divides a "sum" itself divides by Σ w.

Every loss returns a :class:`~emdlm._output.LossOutput` (``loss`` and ``components``). The
numeric parameters of a registered objective are checked against the registry's declared
domains (``ObjectiveSpec.domains``) when the class is constructed, before its ``__init__``
runs (:meth:`EMDLMLoss.__new__`): NaN, ±inf and out-of-domain values are a ValueError naming
the class and the parameter, the same check the config makes of ``objective.params``.
:mod:`emdlm.objective_specs` registers each objective by name; tests/test_conformance.py runs
one suite over every registered objective (equal paths, padding, reduction, gradient
accumulation, compile), so a new objective is tested everywhere by being registered.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from emdlm._output import LossOutput
from emdlm.objective_specs import spec_of_class

if TYPE_CHECKING:
    from emdlm.ops.chunk_objective import ChunkObjective

#: The logit transforms a ``from_hidden`` may be asked to apply (see
#: :class:`emdlm.integrations.hidden_forward.OutputHead`): every emdlm loss takes both.
HIDDEN_TRANSFORMS: tuple[str, ...] = ("logit_scale", "softcap")


class EMDLMLoss(nn.Module):
    """Base class of every emdlm loss: the declarations above, with their defaults, and the one
    ``from_hidden``.

    A subclass sets ``reduction`` and ``ignore_index`` in ``__init__``, implements
    :meth:`logits_loss` (``forward``, the one call signature, checks the keywords and calls it)
    and, when ``has_from_hidden`` (the default), :meth:`chunk_objective`: the per-chunk function
    of :mod:`emdlm.ops.chunked` that ``from_hidden`` runs on the LM head's rows. A class that
    declares ``has_from_hidden = False`` gets a ``from_hidden`` that refuses by name.
    """

    needs_teacher: ClassVar[bool] = False
    takes_number_mask: ClassVar[bool] = False
    takes_loss_weights: ClassVar[bool] = False
    has_from_hidden: ClassVar[bool] = True
    hidden_transforms: ClassVar[tuple[str, ...]] = HIDDEN_TRANSFORMS

    reduction: str
    ignore_index: int

    def __new__(cls, *args: Any, **kwargs: Any) -> EMDLMLoss:
        """Refuse, before ``__init__`` runs, a parameter outside the domain that the objective
        registry declares for it (:func:`check_declared_params`)."""
        check_declared_params(cls, args, kwargs)
        return super().__new__(cls)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.has_from_hidden and "from_hidden" not in cls.__dict__:
            cls.from_hidden = _refuse_from_hidden  # type: ignore[method-assign]

    def forward(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        *,
        number_mask: torch.Tensor | None = None,
        teacher_logits: torch.Tensor | None = None,
        loss_weights: torch.Tensor | None = None,
        **options: Any,
    ) -> LossOutput:
        """The loss of ``logits`` [..., V] against ``labels`` [...] (aligned, no shift inside):
        the keywords checked against the declarations (:meth:`check_call`), then
        :meth:`logits_loss` with those the loss declares and its own ``options``."""
        self.check_call(number_mask, teacher_logits, loss_weights)
        if self.takes_number_mask:
            options["number_mask"] = number_mask
        if self.needs_teacher:
            options["teacher_logits"] = teacher_logits
        if loss_weights is not None:
            return self.weighted_logits_loss(logits, labels, loss_weights, **options)
        return self.logits_loss(logits, labels, **options)

    def weighted_logits_loss(
        self, logits: torch.Tensor, labels: torch.Tensor, loss_weights: torch.Tensor, **given: Any
    ) -> LossOutput:
        """The loss of given logits with per-token ``loss_weights`` (a loss that declares
        ``takes_loss_weights``): its :meth:`chunk_objective`, weighted, run over the logits by
        :func:`emdlm.ops.chunked.chunked_logits_loss` (the same objective ``from_hidden``
        runs, so both routes agree). A class that declares ``takes_loss_weights`` without a
        weighable chunk objective (one with ``weigh_tokens``) overrides this."""
        from emdlm.ops.chunked import chunked_logits_loss
        from emdlm.ops.head import HeadOptions

        labels = drop_zero_weights(labels, loss_weights, self.ignore_index, logits.device)
        objective, labels = self.chunk_objective(logits, labels, **given)
        _weigh(objective, loss_weights, logits)
        head = HeadOptions(
            ignore_index=self.ignore_index,
            reduction=self.reduction,  # type: ignore[arg-type]
            chunk_size=self.from_hidden_chunk_rows(logits.shape[-1]),
        )
        out = chunked_logits_loss(logits, labels, objective, head)
        return self._after_logits(out, objective, logits)

    def logits_loss(self, logits: torch.Tensor, labels: torch.Tensor, **given: Any) -> LossOutput:
        """What a subclass implements: the loss of given logits, with ``number_mask=`` when it
        declares ``takes_number_mask``, ``teacher_logits=`` (never None) when it declares
        ``needs_teacher``, and its own keywords (NTIL's ``generator=``)."""
        raise NotImplementedError(f"{type(self).__name__} implements no logits_loss")

    def check_call(
        self,
        number_mask: torch.Tensor | None,
        teacher_logits: torch.Tensor | None,
        loss_weights: torch.Tensor | None,
    ) -> None:
        """Refuse, by name, a call's keyword that this loss's declarations do not allow: a
        ``number_mask`` without ``takes_number_mask``, teacher logits missing where
        ``needs_teacher`` or given where not, and ``loss_weights`` without
        ``takes_loss_weights`` (NotImplementedError). Every ``forward`` and ``from_hidden``
        calls it first."""
        name = type(self).__name__
        if loss_weights is not None and not self.takes_loss_weights:
            raise NotImplementedError(
                f"{name} takes no loss_weights (per-token weights; takes_loss_weights is "
                "False): pass loss_weights=None"
            )
        if number_mask is not None and not self.takes_number_mask:
            raise ValueError(
                f"{name} scores no numbers (takes_number_mask is False): pass number_mask=None"
            )
        if self.needs_teacher and teacher_logits is None:
            raise ValueError(f"{name} distils from a teacher: pass teacher_logits=")
        if teacher_logits is not None and not self.needs_teacher:
            raise ValueError(
                f"{name} does not distil (needs_teacher is False): pass teacher_logits=None"
            )

    def logged_loss_note(self) -> str | None:
        """One line saying how the logged ``loss`` relates to ``ce`` when a stop-gradient mix
        makes its value something other than what its name suggests (``emdlm train`` prints
        it once at the start), or None."""
        return None

    def chunk_objective(
        self, logits: torch.Tensor, labels: torch.Tensor, **options: Any
    ) -> tuple[ChunkObjective, torch.Tensor]:
        """The loss as a fresh :class:`emdlm.ops.chunk_objective.ChunkObjective` for one call.

        Args:
            logits: [..., V] logits, or the zero-stride stand-in ``from_hidden`` passes (read
                for the vocabulary size, shape, dtype and device only).
            labels: [...] integer labels aligned with ``logits``.
            options: the loss's own keywords of a call (``number_mask=`` for the losses that
                declare ``takes_number_mask``, ``teacher_logits=`` for those that declare
                ``needs_teacher``, ``generator=`` for NTIL's Gumbel noise); a loss
                that takes none refuses them (TypeError).

        Returns:
            (objective, labels): the labels as the engine should read them (on the logits'
            device where the objective put them there).
        """
        raise NotImplementedError(f"{type(self).__name__} implements no chunk_objective")

    def from_hidden(
        self,
        hidden: torch.Tensor,
        lm_head_weight: torch.Tensor,
        labels: torch.Tensor,
        lm_head_bias: torch.Tensor | None = None,
        *,
        number_mask: torch.Tensor | None = None,
        teacher_logits: torch.Tensor | None = None,
        loss_weights: torch.Tensor | None = None,
        logit_scale: float | None = None,
        softcap: float | None = None,
        chunk_size: int | None = None,
        **options: Any,
    ) -> LossOutput:
        """The same loss from hidden states, never materializing the [N, V] logits.

        Value, components and gradients (hidden, weight, bias) equal those of
        ``self(cap·tanh(s·(hidden @ W.T + b)/cap), labels, number_mask=...)`` (given the same
        noise, for NTIL): :meth:`chunk_objective` runs through the chunked-loss engine
        (:func:`emdlm.ops.chunked.chunked_linear_loss`), over chunks of rows as Liger-Kernel's
        fused linear cross-entropy.

        Args:
            hidden: [..., H] final hidden states, aligned with ``labels`` (no shift inside).
            lm_head_weight: [V, H] output embedding, same dtype as ``hidden``.
            labels: [...] integer labels.
            lm_head_bias: optional [V] head bias.
            number_mask, teacher_logits, loss_weights: as in ``forward`` (:meth:`check_call`).
            logit_scale: s, logits s·(hWᵀ + b) (model families with a logit scale).
            softcap: cap, logits cap·tanh(z/cap) (Gemma-2's final logit soft-capping).
            chunk_size: rows per chunk (default: the loss's own chunk setting, see its
                docstring, else ``DEFAULT_CHUNK_ELEMENTS // V`` rows, :mod:`emdlm.ops.chunked`,
                so the scratch stays a fixed size whatever the vocabulary).
            options: the loss's own keywords, passed to :meth:`chunk_objective` (NTIL's
                ``generator=`` for the Gumbel noise).
        """
        from emdlm.ops.chunked import chunked_linear_loss
        from emdlm.ops.head import HeadOptions, check_linear_inputs, stand_in_logits

        self.check_call(number_mask, teacher_logits, loss_weights)
        # Shapes and dtypes only (the engine checks the label range in its one host sync).
        check_linear_inputs(
            hidden, lm_head_weight, labels, lm_head_bias, self.ignore_index, check_range=False
        )
        stand_in = stand_in_logits(hidden, lm_head_weight.shape[0])
        if loss_weights is not None:
            labels = drop_zero_weights(labels, loss_weights, self.ignore_index, hidden.device)
        if number_mask is not None:
            options["number_mask"] = number_mask
        if self.needs_teacher:  # a distilling loss with a from-hidden path reads them there
            options["teacher_logits"] = teacher_logits
        objective, labels = self.chunk_objective(stand_in, labels, **options)
        if loss_weights is not None:
            _weigh(objective, loss_weights, stand_in)
        if chunk_size is None:
            chunk_size = self.from_hidden_chunk_rows(lm_head_weight.shape[0])
        head = HeadOptions(
            ignore_index=self.ignore_index,
            reduction=self.reduction,  # type: ignore[arg-type]
            chunk_size=chunk_size,
            logit_scale=logit_scale,
            softcap=softcap,
        )
        out = chunked_linear_loss(hidden, lm_head_weight, lm_head_bias, labels, objective, head)
        return self._after_from_hidden(out, objective, hidden, lm_head_weight, lm_head_bias, head)

    def from_hidden_chunk_rows(self, vocab: int) -> int:
        """Rows per chunk of :meth:`from_hidden` on a ``vocab``-token output embedding when
        the call gives no ``chunk_size``: the engine's default ``DEFAULT_CHUNK_ELEMENTS // V``
        (:func:`emdlm.ops.head.default_chunk_rows`); a loss with its own chunk setting
        overrides this."""
        from emdlm.ops.head import default_chunk_rows

        return default_chunk_rows(vocab)

    def _after_from_hidden(
        self,
        out: LossOutput,
        objective: Any,
        hidden: torch.Tensor,
        lm_head_weight: torch.Tensor,
        lm_head_bias: torch.Tensor | None,
        head: Any,
    ) -> LossOutput:
        """Hook: a term the engine leaves to the loss (number-level NTL's dense lse rows);
        ``head`` the call's :class:`emdlm.ops.head.HeadOptions`."""
        return out

    def _after_logits(self, out: LossOutput, objective: Any, logits: torch.Tensor) -> LossOutput:
        """Hook: the same term on :meth:`weighted_logits_loss`'s route (given logits)."""
        return out


def check_declared_params(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """ValueError naming ``cls`` and each parameter of the call ``cls(*args, **kwargs)`` that
    lies outside the domain its registered objective declares (``ObjectiveSpec.domains`` of
    :func:`emdlm.objective_specs.spec_of_class`). Only the values given are checked (the
    defaults are legal); a call that does not bind to the signature is left to ``__init__``
    (its own TypeError), as is a class with no registered objective in its MRO."""
    spec = spec_of_class(cls)
    if spec is None or not (args or kwargs):
        return
    try:
        bound = inspect.signature(cls.__init__).bind(None, *args, **kwargs)  # None: self
    except TypeError:
        return
    given: dict[str, Any] = {}
    for name, value in list(bound.arguments.items())[1:]:
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            given.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            given[name] = value
    problems = spec.param_problems(given)
    if problems:
        raise ValueError(f"{cls.__name__}: {'; '.join(problems)}")


def check_loss_weights(loss_weights: Any, labels: torch.Tensor) -> None:
    """ValueError unless ``loss_weights`` is a floating-point tensor of the labels' shape (its
    values, finite and ≥ 0, are checked in the chunk engine's one host sync)."""
    if not isinstance(loss_weights, torch.Tensor) or not torch.is_floating_point(loss_weights):
        got = loss_weights.dtype if isinstance(loss_weights, torch.Tensor) else type(loss_weights)
        raise ValueError(f"loss_weights must be a floating-point tensor, got {got}")
    if loss_weights.shape != labels.shape:
        raise ValueError(
            f"loss_weights must have the labels' shape {tuple(labels.shape)}, got "
            f"{tuple(loss_weights.shape)}"
        )


def drop_zero_weights(
    labels: torch.Tensor, loss_weights: Any, ignore_index: int, device: torch.device
) -> torch.Tensor:
    """``labels`` on ``device`` (the logits' or hidden states') with every token of weight 0 set
    to ``ignore_index`` (no host sync), after checking the weights' type and shape
    (:func:`check_loss_weights`).

    Done before a loss looks at its labels (number spans, counts), so a weight of 0 scores a
    token exactly as an ignored label, also inside a number: there the number ends (or is
    split) at that token, as at an ignored label."""
    check_loss_weights(loss_weights, labels)
    return labels.to(device).masked_fill(loss_weights.to(device) == 0, ignore_index)


def _weigh(objective: Any, loss_weights: torch.Tensor, like: torch.Tensor) -> None:
    """Hand ``loss_weights`` (type and shape already checked by :func:`drop_zero_weights`),
    flat, in the compute dtype on ``like``'s device, to ``objective.weigh_tokens``
    (NotImplementedError where the objective does not declare ``takes_token_weights``)."""
    from emdlm.functional._common import compute_dtype

    objective.weigh_tokens(
        loss_weights.to(device=like.device, dtype=compute_dtype(like.dtype)).reshape(-1)
    )


def _refuse_from_hidden(
    self: EMDLMLoss,
    hidden: Any = None,
    lm_head_weight: Any = None,
    labels: Any = None,
    lm_head_bias: Any = None,
    *,
    number_mask: Any = None,
    teacher_logits: Any = None,
    loss_weights: Any = None,
    logit_scale: Any = None,
    softcap: Any = None,
    chunk_size: Any = None,
    **options: Any,
) -> LossOutput:
    """``from_hidden`` of a loss that declares ``has_from_hidden = False`` (the one signature,
    :meth:`EMDLMLoss.from_hidden`): refuses by name."""
    raise NotImplementedError(
        f"{type(self).__name__} has no from-hidden path (has_from_hidden is False): use the "
        "logits path (from_hidden=False, train.fused_linear: false)"
    )


__all__ = ["HIDDEN_TRANSFORMS", "EMDLMLoss", "check_declared_params", "check_loss_weights"]
