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
    """

    loss: torch.Tensor
    components: dict[str, torch.Tensor | float] = field(default_factory=dict)

    def detached_components(self) -> dict[str, float]:
        """All components as Python floats (one host sync per component: call when logging)."""
        return {k: float(v) for k, v in self.components.items()}
