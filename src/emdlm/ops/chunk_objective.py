"""The objective base of the chunk engine: what a per-chunk function is, returns and counts.

A :class:`ChunkObjective` gives, for the rows [start, start + n) of a call, the summed loss
L_c of their logits z_c and its scaled gradient g_c = k·dL_c/dz_c, plus optional sums ``stats``
that :meth:`ChunkObjective.finish` turns into an after-pass term and the call's components
(the drivers, :mod:`emdlm.ops.chunked`, run it; the scheme of Liger-Kernel's chunked-loss base,
linkedin/Liger-Kernel src/liger_kernel/chunked_loss/fused_linear_preference.py). Over the
counted rows C (labels not ``ignore_index``), with per-token weights w_t when given
(:meth:`ChunkObjective.weigh_tokens`, else w_t = 1)::

    count = Σ_{t∈C} w_t                                   (:meth:`ChunkObjective.counted`)
    k     = 1 / count  ("mean", 1 when count = 0)  or 1  ("sum")   (:func:`count_divisor`)
    loss  = k·(Σ_c L_c + L_finish)

so a weighted "mean" is Σ w_t·l_t / Σ w_t (0 when Σ w = 0), as ntloss's ``loss_weights``
(AI4SD/number-token-loss, ``ntloss/core.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class ChunkOut:
    """What an objective returns for one chunk.

    Attributes:
        loss: 0-d summed loss of the chunk's counted rows (compute dtype, no reduction).
        grad: [n, V] grad_scale·d(loss)/d(z_c) in the compute dtype, or None when no gradient
            was asked for. It may be ``out`` (preferred: no copy) or the objective's own
            buffer. Rows of ignored labels may hold anything: the drivers zero them.
        stats: [S] sums the objective wants back in ``finish`` (compute dtype).
        scaled: False when ``grad`` is d(loss)/d(z_c) without grad_scale (where applying it
            would cost the objective a pass of its own): the driver applies it, the logits
            driver together with grad_output in backward.
    """

    loss: torch.Tensor
    grad: torch.Tensor | None
    stats: torch.Tensor
    scaled: bool = True


@dataclass
class SparseLogitGrad:
    """Gradient of the after-pass term w.r.t. a few logits z[rows[m], ids[m, k]].

    Attributes:
        rows: [M] long flattened positions.
        ids: [M, K] long vocabulary ids (padding columns must carry grad 0).
        grad: [M, K] d(term)/dz, unreduced (sum units, as ``ChunkOut.loss``).
        logits: [M, K] the (scaled, capped) logits z at those places (for the soft-cap chain).
        columns: optional, called when the driver needs them (from hidden states):
            (uniq [U], col [M, K]), distinct ids covering ``ids`` (sorted) and the column of
            each entry in them (a padding entry may point at any column), as
            ``torch.unique(ids, return_inverse=True)`` would give but without its host sync;
            None: the driver takes that unique (one host sync).
    """

    rows: torch.Tensor
    ids: torch.Tensor
    grad: torch.Tensor
    logits: torch.Tensor
    columns: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None


@dataclass
class Finish:
    """What an objective returns after the pass.

    Attributes:
        extra_loss: 0-d loss added to Σ_c L_c before the reduction (sum units).
        sparse: the extra loss's gradient on a few logits, or None.
        components: detached diagnostics for the :class:`LossOutput`.
    """

    extra_loss: torch.Tensor
    sparse: SparseLogitGrad | None
    components: dict[str, torch.Tensor] = field(default_factory=dict)


class ChunkObjective:
    """Base of the per-chunk functions plugged into the two drivers,
    :func:`emdlm.ops.chunked.chunked_linear_loss` and
    :func:`emdlm.ops.chunked.chunked_logits_loss`.

    Subclasses implement :meth:`chunk`; :meth:`host_sizes`, :meth:`begin` and :meth:`finish`
    are optional hooks. An objective instance serves one call (it may keep state between
    chunks).
    """

    #: Number of summed statistics returned per chunk (length of ``ChunkOut.stats``).
    n_stats: int = 1
    #: Whether :meth:`weigh_tokens` is implemented: the objective scales each token's terms by
    #: its weight w_t (its ``chunk`` / ``finish`` read :attr:`token_weights`).
    takes_token_weights: bool = False
    #: [N] per-token weights of the call (:meth:`weigh_tokens`), or None.
    token_weights: torch.Tensor | None = None

    def weigh_tokens(self, weights: torch.Tensor) -> None:
        """Score each flattened token t with weight w_t (``weights`` [N] floating point on the
        logits' device). Their values are checked (finite and ≥ 0) by the drivers in the
        call's one host sync (``emdlm.ops.chunked._Pass.of``); :meth:`counted` then gives
        Σ_t w_t over the counted tokens. An objective that does not declare
        ``takes_token_weights`` refuses."""
        if not self.takes_token_weights:
            raise NotImplementedError(
                f"{type(self).__name__} takes no per-token weights (takes_token_weights is False)"
            )
        self.token_weights = weights.reshape(-1)

    def chunk_weights(
        self, valid: torch.Tensor, start: int, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """The chunk's per-token weights [n] in ``dtype``, 0 where ignored (None: unweighted)."""
        if self.token_weights is None:
            return None
        w = self.token_weights[start : start + valid.shape[0]].to(dtype)
        return torch.where(valid, w, w.new_zeros(()))

    def host_sizes(
        self, labels: torch.Tensor, valid: torch.Tensor, bounds: list[int], vocab: int
    ) -> torch.Tensor | None:
        """Values the objective needs on the host (sizes of its tensors), as a 1-D long tensor
        on the labels' device, or None. The driver reads them together with its own (the label
        range check, the ignored rows) in ONE host sync per call and passes them to
        :meth:`begin`. ``labels`` [N] long, ``valid`` [N] bool, ``bounds`` the first row of
        every chunk then N, ``vocab`` V."""
        return None

    def begin(self, starts: list[int], n_rows: int, sizes: list[int]) -> None:
        """Called once before the first chunk: the first row of every chunk, N rows in all, and
        the values of :meth:`host_sizes` (empty when it gave None)."""

    def counted(self, valid: torch.Tensor) -> torch.Tensor:
        """0-d count the "mean" reduction divides by (and ``finish`` gets):
        :func:`token_count` of ``valid`` with the call's :attr:`token_weights`."""
        return token_count(valid, self.token_weights)

    def chunk(
        self,
        z: torch.Tensor,
        out: torch.Tensor,
        labels: torch.Tensor,
        valid: torch.Tensor,
        start: int,
        grad_scale: torch.Tensor | None,
    ) -> ChunkOut:
        """Loss and scaled gradient of rows [start, start + n).

        Args:
            z: [n, V] logits of the chunk, read only, any float dtype and strides; it may be
                ``out`` itself, the same tensor object (from hidden states), then it may be
                overwritten (test ``z is out``, not ``data_ptr``: the step must trace).
            out: [n, V] contiguous compute-dtype buffer the objective owns for this chunk.
            labels: [n] long labels; valid: [n] bool, False where ignored.
            start: first flattened row of the chunk.
            grad_scale: 0-d multiplier of the returned gradient (k·s); None = values only.
                An objective may leave it to the driver (``ChunkOut.scaled = False``).
        """
        raise NotImplementedError

    def finish(self, stats: torch.Tensor, count: torch.Tensor, want_grad: bool) -> Finish:
        """After the pass: ``stats`` [S] summed over chunks, ``count`` counted labels (0-d)."""
        return Finish(extra_loss=stats.new_zeros(()), sparse=None)

    def predicted(self) -> torch.Tensor | None:
        """After the pass: the argmax token id of every row's logits, [N] long in row order
        (any value at ignored rows: the drivers put ``ignore_index`` there), taken chunk by
        chunk; None (the default) when the objective was not asked for them."""
        return None


def predicted_tokens(
    objective: ChunkObjective, labels: torch.Tensor, ignore_index: int
) -> torch.Tensor | None:
    """``objective.predicted()`` in the labels' shape, ``ignore_index`` where the label is
    ignored (elementwise, no host sync); None when it gave none."""
    flat = objective.predicted()
    if flat is None:
        return None
    flat = flat.to(labels.device)
    return torch.where(labels.reshape(-1) != ignore_index, flat, ignore_index).view(labels.shape)


def token_count(valid: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """0-d count of the counted tokens: Σ_t valid_t, or with per-token ``weights`` (the shape
    of ``valid``) their weight sum Σ_{t: valid_t} w_t (no host sync)."""
    if weights is None:
        return valid.sum()
    return torch.where(valid, weights, 0.0).sum()


def count_divisor(count: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """What a "mean" divides by, in ``dtype`` (None: the count's own): the 0-d ``count``
    (:func:`token_count`: counted labels, or their weight sum Σ w_t with per-token weights), or
    1 where it is 0, so that nothing counted gives an exact 0. Not ``clamp_min(1)``: a weight
    sum may lie in (0, 1)."""
    divisor = torch.where(count > 0, count, 1)
    return divisor if dtype is None else divisor.to(dtype)


__all__ = [
    "ChunkObjective",
    "ChunkOut",
    "Finish",
    "SparseLogitGrad",
    "count_divisor",
    "predicted_tokens",
    "token_count",
]
