"""The shape of every attention kernel's path table (PyTorch SDPA's backend list with its ``can_use_*``
checks, xformers' fmha operator list): `geoattn.attention.rt.dispatch`, `geoattn.attention.rotor.dispatch`
and `geoattn.attention.rfa` each keep one tuple of `Path` rows in priority order and choose with
`choose`; `explain` says for a call what every row thinks of it.

A row's ``checks`` are small functions of the call, each returning None where its fact holds and
else the reason the row declines; every rule of a kernel's dispatch is one of them (none is an ``if``
outside the table). They read static facts only (device, dtype, shapes, which tensors require
gradients, what was asked for), never a tensor's values, and never build or compile anything: they run
under ``torch.compile(fullgraph=True)`` and on every call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

Check = Callable[[Any], "str | None"]


class Asked(Protocol):
    """What `choose` reads of a call: the backend asked for (``"auto"`` or a row's name)."""

    backend: str


class Path(NamedTuple):
    """One row of a kernel's table."""

    name: str
    checks: tuple[Check, ...]  # each: None where its fact holds, else why the row declines the call
    run: Callable  # the row's implementation, called with the call
    test: str  # the test that holds it to the reference, values and gradients

    def reasons(self, call: Any) -> tuple[str, ...]:
        """Every reason this row declines ``call`` (all of its checks, not the first only); ``()``: it
        serves the call."""
        return tuple(reason for reason in (check(call) for check in self.checks) if reason is not None)


def no_weights(call: Any) -> str | None:
    """The check of every row but a reference: the ``(B, H, N, N)`` weights are the reference's alone."""
    if call.return_weights:
        return "return_weights=True: only the reference has the N × N weights (backend='reference')"
    return None


def backends(paths: Sequence[Path]) -> tuple[str, ...]:
    """The ``backend=`` values a table accepts: ``"auto"`` and each row's name."""
    return ("auto", *(path.name for path in paths))


def choose(paths: Sequence[Path], call: Asked, kernel: str) -> Path:
    """The row that runs ``call``: under ``backend="auto"`` the first row with no reason to decline;
    a row named explicitly runs it or refuses with a ValueError naming all its reasons."""
    if call.backend == "auto":
        for path in paths:
            if not path.reasons(call):
                return path
        raise ValueError(f"{kernel}: no path serves this call:\n{describe(paths, call)}")
    for path in paths:
        if path.name == call.backend:
            reasons = "; ".join(path.reasons(call))
            if reasons:
                raise ValueError(f"{kernel}: backend={call.backend!r} cannot run this call: {reasons}")
            return path
    raise ValueError(f"{kernel}: backend must be one of {backends(paths)}, got {call.backend!r}")


def explain(paths: Sequence[Path], call: Any) -> list[tuple[str, tuple[str, ...]]]:
    """Every row's answer for ``call``, in priority order: ``[(name, reasons)]``, ``()`` where the row
    serves it."""
    return [(path.name, path.reasons(call)) for path in paths]


def describe(paths: Sequence[Path], call: Any) -> str:
    """`explain` as text, one line per row (``name: serves`` or ``name: reason; reason``)."""
    return "\n".join(f"  {name}: {'; '.join(reasons) or 'serves'}" for name, reasons in explain(paths, call))
