"""The contract between the trainer and a task (lm, filter, nbody).

A task owns its data, builds the model for a ``--model`` name, and measures its own metrics. The
trainer owns everything else (optimiser, schedule, checkpoints, DDP, logging). Batches are drawn
from a ``torch.Generator`` that the trainer seeds and checkpoints, so the data position resumes
exactly and every DDP rank can draw the same global batch and keep its own slice.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import Tensor, nn


class Task(ABC):
    """One training problem.

    Subclasses set ``name`` and ``models`` (the ``--model`` values they accept) and implement the
    abstract methods. A model built by :meth:`build_model` is called as ``model(x, y)`` and returns
    ``(prediction, loss)`` with ``loss`` a scalar tensor.
    """

    name: ClassVar[str]
    models: ClassVar[tuple[str, ...]]

    @abstractmethod
    def get_batch(
        self, split: str, batch_size: int, generator: torch.Generator, device: torch.device | str = "cpu"
    ) -> tuple[Tensor, Tensor]:
        """Draw ``(x, y)`` for ``split`` in {"train", "val", ...} with ``generator`` (on the CPU)."""

    @abstractmethod
    def build_model(self, model: str, config: Any) -> nn.Module:
        """The network for ``--model model``; raises ``ValueError`` naming the valid models."""

    def metrics(self, prediction: Tensor, y: Tensor) -> dict[str, float]:
        """Task metrics of one evaluation batch (averaged over batches by the trainer)."""
        return {}

    def meta(self) -> dict[str, Any]:
        """JSON-serialisable facts saved with every checkpoint (vocabulary, simulator parameters)."""
        return {"task": self.name}

    def baselines(self, split: str = "val") -> dict[str, float]:
        """Reference numbers beside the learned models (e.g. the optimal filter), keyed by name."""
        return {}
