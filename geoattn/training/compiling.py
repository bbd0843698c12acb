"""``torch.compile`` of a model's training step, as the trainer and `geoattn bench lm` run it."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from geoattn.compile import own_code


class CompiledModel:
    """``torch.compile(module)``, called with the custom autograd Functions of the kernels admitted
    to torch's autograd cache.

    The hypersphere models' graphs hold ``torch.autograd.Function`` s
    (`geoattn.layers.sphere._SphereRetraction`). By default (torch 2.13) the autograd
    cache skips any graph that has one, so every new process traces and partitions the joint graph
    again, even with a warm compile cache, where the transformer's graph loads from it. Dynamo traces such a
    Function's forward and backward into subgraphs of the graph the cache key hashes, so a changed Function
    still misses the cache.

    Calls: ``model(*args, **kwargs)`` as the module's own ``forward``.
    """

    def __init__(self, module: nn.Module) -> None:
        self.compiled = torch.compile(module)

    def __call__(self, *args, **kwargs):
        with torch._functorch.config.patch(autograd_cache_allow_custom_autograd_functions=True):
            return self.compiled(*args, **kwargs)


def weight_normalizer(model: nn.Module, compiled: bool) -> Callable[[], None]:
    """``model.normalize_weights`` (the hypersphere models' renormalisation after each optimiser step),
    through ``torch.compile`` when ``compiled``: the rt model renormalises 17 matrices, three eager
    operations each, and one compiled kernel replaces them (see `geoattn bench lm --profile`'s
    ``renormalise`` phase). For the other models it does nothing either way.
    """
    if not compiled:
        return model.normalize_weights

    def normalize() -> None:
        model.normalize_weights()

    # a code object per model, so that the models of one process do not share a recompile limit
    return torch.compile(own_code(normalize, f"normalize_weights_{id(model):x}"))
