"""What the kernels and the trainer share about `torch.compile`: one size policy and `own_code`.

Policy: a kernel runs its elementwise work through `torch.compile` when one call touches at least
`COMPILE_MIN_ELEMENTS` elements (`worth_compiling`), counted as the kernel's natural unit: score
pairs for attention blocks (B·H·queries·keys), products × blades for the Clifford algebra's bilinear
maps (rows · 2ⁿ). Below it the compiled call's overhead outweighs its speed, and tests and toy sizes
never wait for a compilation.
"""

from __future__ import annotations

import types
from collections.abc import Callable

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
