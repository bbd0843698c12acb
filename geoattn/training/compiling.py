"""``torch.compile`` of a model's training step, as the trainer and `geoattn bench lm` run it, and the
trainer's default for it (:func:`compile_choice`).

Regional compilation: each block of a model's stack (the children of an ``nn.ModuleList`` that are
all one class) is compiled, the rest runs eagerly. The blocks share their ``forward``'s code
and Dynamo treats their parameters as inputs, so it traces one block and every layer reuses that
graph: the compile costs one block, not ``n_layer`` of them inlined into one graph.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from geoattn.core.compile import own_code

# The two estimates of the default's rule (compile_choice), measured with the blocks compiled one at
# a time on a 2-core Intel Xeon (AVX-512), whole runs from fresh processes (`geoattn bench train --cache
# cold -- --compile true`, BENCHMARKS.md): the rt model's first compiled step from an empty inductor
# cache, 18.3 s (17.7 s in `geoattn bench lm`), and the share of its eager step the compiled one saves,
# 24 % (33.4 against 43.9 ms; 29 % / 25 % at T = 64 / 256 in `geoattn bench lm --compile both`).
COMPILE_COST_S = 18.0
COMPILE_SAVING = 0.24
MEASURED_STEPS = 5  # eager steps timed at a run's start (after one untimed), their median for the rule


def compile_regions(module: nn.Module, active: Callable[[], bool]) -> list[nn.Module]:
    """Compile every block of ``module``'s stacks: the children of each outermost ``nn.ModuleList``
    whose children are all one class. A block runs its compiled forward while ``active()`` (the
    training step) and its eager one otherwise, so evaluation (eval mode, other batch shapes) does not
    recompile. Returns the compiled blocks (empty: none)."""
    blocks: list[nn.Module] = []
    taken: list[str] = []
    for name, child in module.named_modules():
        inside = any(name.startswith(prefix + ".") for prefix in taken)
        if inside or not isinstance(child, nn.ModuleList) or len({type(b) for b in child}) != 1:
            continue
        for index, block in enumerate(child):
            block.forward = _switched(active, torch.compile(block.forward), block.forward)
            blocks.append(block)
            taken.append(f"{name}.{index}" if name else str(index))
    return blocks


def _switched(active: Callable[[], bool], compiled: Callable, eager: Callable) -> Callable:
    def forward(*args, **kwargs):
        return (compiled if active() else eager)(*args, **kwargs)

    return forward


class CompiledModel:
    """``module`` with its blocks compiled for its calls through this wrapper (:func:`compile_regions`;
    a module without a stack is compiled whole), called with the custom autograd Functions of the
    kernels admitted to torch's autograd cache.

    The hypersphere models' graphs hold ``torch.autograd.Function`` s
    (`geoattn.layers.sphere._SphereRetraction`). By default (torch 2.13) the autograd
    cache skips any graph that has one, so every new process traces and partitions the joint graph
    again, even with a warm compile cache, where the transformer's graph loads from it. Dynamo traces such a
    Function's forward and backward into subgraphs of the graph the cache key hashes, so a changed Function
    still misses the cache.

    Calls: ``model(*args, **kwargs)`` as the module's own ``forward``; the module called directly
    (evaluation) runs eagerly.
    """

    def __init__(self, module: nn.Module) -> None:
        self.stepping = False
        self.blocks = compile_regions(module, lambda: self.stepping)
        self.compiled = module if self.blocks else torch.compile(module)

    def __call__(self, *args, **kwargs):
        self.stepping = True
        try:
            with torch._functorch.config.patch(autograd_cache_allow_custom_autograd_functions=True):
                return self.compiled(*args, **kwargs)
        finally:
            self.stepping = False


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


@dataclass(frozen=True)
class CompileChoice:
    """Whether a run's training step is compiled, and why (``config.json``'s ``compiled``)."""

    on: bool
    why: str


def compile_choice(
    setting: bool | None, wins: bool, max_iters: int, step_seconds: Callable[[], float]
) -> CompileChoice:
    """The trainer's ``--compile``: ``setting`` if given; else off for a model whose compiled step
    measured no faster (``wins`` false: its row's ``compiles``), else on when the run is long enough
    to win the compile back::

        max_iters · COMPILE_SAVING · step_seconds()  >  COMPILE_COST_S

    ``step_seconds()`` measures this run's eager step (its model, batch, context and machine), so a
    bigger model or a slower machine compiles from fewer steps; the saving and the compile cost are
    the estimates above.
    """
    if setting is not None:
        return CompileChoice(setting, f"--compile {str(setting).lower()}")
    if not wins:
        return CompileChoice(False, "its compiled step measured no faster than its eager one")
    step = step_seconds()
    saved = max_iters * COMPILE_SAVING * step
    on = saved > COMPILE_COST_S
    return CompileChoice(
        on,
        f"{max_iters} steps x {COMPILE_SAVING:.0%} of a {1e3 * step:.0f} ms eager step = {saved:.0f} s "
        f"{'>' if on else '<='} {COMPILE_COST_S:.0f} s to compile",
    )


def eager_step_seconds(model: nn.Module, batch: Callable[[], tuple[Any, Any]]) -> float:
    """The median wall of :data:`MEASURED_STEPS` eager forward and backward passes of ``model`` on
    ``batch()`` (after one untimed), leaving its gradients, buffers and torch's random state as they
    were (the run's first step is the same with or without the measurement)."""
    buffers = [b.clone() for b in model.buffers()]
    grads = [p.grad for p in model.parameters()]
    walls = []
    with torch.random.fork_rng():
        x, y = batch()
        for _ in range(MEASURED_STEPS + 1):
            start = time.perf_counter()
            _, loss = model(x, y)
            loss.backward()
            if loss.is_cuda:  # the backward's kernels are queued, not done
                torch.cuda.synchronize()
            walls.append(time.perf_counter() - start)
    with torch.no_grad():
        for b, saved in zip(model.buffers(), buffers):
            b.copy_(saved)
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    return statistics.median(walls[1:])
