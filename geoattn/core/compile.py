"""What the kernels and the trainer share about `torch.compile`: one size policy, `own_code`, and the
markers `constant_result` and `disabled`, which leave ``torch._dynamo`` unimported until something
compiles (importing it takes seconds, and a run that compiles nothing should not pay them).

Policy: a kernel runs its elementwise work through `torch.compile` when one call touches at least
`COMPILE_MIN_ELEMENTS` elements (`worth_compiling`), counted as the kernel's natural unit: score
pairs for attention blocks (B·H·queries·keys), for the Clifford algebra's bilinear maps the
``(rows, 2ⁿ, 2ⁿ)`` intermediate their eager forms build (rows · 4ⁿ: in Cl(3) from 4,096 products on,
where the compiled kernel measured faster than the dense one, forward and backward). Below it the
compiled call's overhead outweighs its speed, and tests and toy sizes never wait for a compilation.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch

COMPILE_MIN_ELEMENTS = 1 << 18


def worth_compiling(elements: int) -> bool:
    """Whether a call that touches ``elements`` elements runs compiled (the policy above)."""
    return elements >= COMPILE_MIN_ELEMENTS


def own_code(fn: Callable, name: str) -> Callable:
    """``fn`` (defaults and closure included) with a code object of its own, named ``name``.

    Dynamo keeps its compiled graphs, and counts its recompile limit, per code object: functions
    compiled once per variant or per model (a process that trains several models, a benchmark's
    variants) need their own, or they share that limit and fall back to eager when it is reached.
    """
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def constant_result(fn: Callable) -> Callable:
    """``torch.compiler.assume_constant_result(fn)`` without importing ``torch._dynamo``: a caller's
    ``torch.compile`` runs ``fn`` at trace time and keeps its result as a constant. The decorator sets
    only this marker (``tests/test_cli.py`` holds the two to the same attributes)."""
    fn._dynamo_marked_constant = True
    return fn


def disabled(fn: Callable) -> Callable:
    """``torch.compiler.disable(fn)`` made at the first call instead of at import (which imports
    ``torch._dynamo``): inside a caller's ``torch.compile`` the call is a graph break and ``fn`` runs
    eagerly, as with the decorator, also where that first call happens during tracing."""
    made: list[Callable] = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not made:
            made.append(torch.compiler.disable(fn))
        return made[0](*args, **kwargs)

    return call
