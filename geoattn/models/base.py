"""The contract between the trainer and a network: :class:`TaskModel`, and the run's :class:`ModelSizes`.

Every network a task hands to the trainer is a :class:`TaskModel`. The trainer asks it exactly the
questions below and nothing else; each has a default, so a new model overrides only what it changes:

| method | what the trainer does with it | default |
| --- | --- | --- |
| ``forward(x, y)`` | ``(prediction, loss)``; ``loss`` a scalar when ``y`` is given | (abstract) |
| ``optim_groups(weight_decay)`` | AdamW parameter groups | decay on matrices only (:func:`decay_groups`) |
| ``normalize_weights()`` | called after every optimiser step | nothing |
| ``attention_maps(x)`` | one ``(B, H, T, T)`` map per layer for ``attention.png`` | ``[]`` (no plot) |
| ``rt_filter_parameters()`` | the first RT layer's (μ_r, σ_t², η_t²) for ``precision.png`` | found by type |
| ``plots(directory)`` | the model's own PNGs in the run directory (e.g. rotor positions) | none |
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from geoattn.layers.rt_block import RTAttention


@dataclass(frozen=True)
class ModelSizes:
    """The run's size settings (``--n-layer --n-head --n-embd --block-size --dropout``).

    Each model maps them onto its own config (``LMConfig.from_sizes``,
    ``RotorTransformerConfig.from_sizes``); fields a model has no use for are ignored.
    """

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    dropout: float = 0.0


def decay_groups(
    model: nn.Module, weight_decay: float, *, decay_matrices: bool = True
) -> list[dict[str, Any]]:
    """AdamW groups: weight decay on matrices (≥ 2-D parameters), none on vectors (norms, scales).

    ``decay_matrices=False`` puts every parameter in the no-decay group (hypersphere models, whose
    weights are renormalised instead of decayed, as nGPT).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not decay_matrices:
        return [{"params": params, "weight_decay": 0.0}]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


class TaskModel(nn.Module):
    """A network the trainer can train (see the module docstring for the contract).

    Subclasses set ``self.config`` (a dataclass, saved in the run's ``config.json``) and implement
    ``forward(x, y=None) -> (prediction, loss | None)``.
    """

    config: Any = None

    def optim_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """AdamW parameter groups; default: decay on matrices, none on vectors."""
        return decay_groups(self, weight_decay)

    def normalize_weights(self) -> None:
        """Called by the trainer after every optimiser step (hypersphere models renormalise here)."""

    def attention_maps(self, x: Tensor) -> list[Tensor]:
        """Explicit attention weights, one ``(B, H, T, T)`` tensor per layer; ``[]`` if none to show."""
        return []

    def rt_filter_parameters(self) -> dict[str, Tensor] | None:
        """``{"mu_r", "sigma_t2", "eta_t2", ...}`` ``(H,)`` of the first RT-Filter layer, or None."""
        for module in self.modules():
            if isinstance(module, RTAttention):
                return module.precision_parameters()
        return None

    def plots(self, directory: Path) -> list[Path]:
        """Write the model's own PNG plots into ``directory``; returns their paths (default: none)."""
        return []

    def num_params(self) -> int:
        """All parameters (tied weights counted once)."""
        return sum(p.numel() for p in self.parameters())
