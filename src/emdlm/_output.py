"""The value every emdlm loss returns."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LossOutput:
    """Result of an emdlm loss call.

    Attributes:
        loss: the scalar to back-propagate (0-d tensor, carries the graph).
        components: detached diagnostics, each a float or a 0-d tensor (no host sync is forced
            inside the loss; call ``float()`` on them once per logging interval).
        predicted_tokens: the argmax token id of the logits at every position (long, the
            labels' shape; ``ignore_index`` where the label is ignored), for a loss asked for
            it (``CrossEntropyLoss(predicted_tokens=True)``, Liger-Kernel's
            ``return_predicted_tokens``), else None. Ties go to the lowest token id, as
            ``torch.argmax``.
    """

    loss: torch.Tensor
    components: dict[str, torch.Tensor | float] = field(default_factory=dict)
    predicted_tokens: torch.Tensor | None = None

    def detached_components(self) -> dict[str, float]:
        """All components as Python floats (one host sync per component: call when logging)."""
        return {k: float(v) for k, v in self.components.items()}
