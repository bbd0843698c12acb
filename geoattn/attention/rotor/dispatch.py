"""The one place that chooses how `rotor_attention` runs: `PATHS`, in priority order, rows of
`geoattn.attention.dispatch.Path` (the shape RT's table has). ``backend="auto"`` takes the first row
none of whose checks declines; a backend named explicitly runs the call or raises a ValueError with
all its reasons; `explain` lists every row's reasons. What a row runs is the head's own kernel, as its
registry entry names it (`geoattn.attention.rotor.heads.HeadType.kernels`): the table knows paths,
the registry knows heads.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from geoattn.algebra.clifford_algebra import CliffordAlgebra
from geoattn.attention import dispatch as table
from geoattn.attention.dispatch import Path
from geoattn.attention.rotor.heads import HeadType


class Call(NamedTuple):
    """One call of `rotor_attention`, checked and in its working dtype: ``q, k (B, H, N, C, dim)``,
    ``v (B, H, N, Cv, dim)``, ``key_mask (B, N)`` bool or None; ``head`` the registry's entry."""

    q: Tensor
    k: Tensor
    v: Tensor
    algebra: CliffordAlgebra
    head: HeadType
    aggregation: str
    causal: bool
    inverse: bool
    key_mask: Tensor | None
    chunk_size: int | None
    backend: str


def _asked_for(call: Call) -> str | None:
    if call.backend == "reference":
        return None
    return "the naive pairwise oracle (N × N versors): only on request (backend='reference')"


def _run(which: int):
    def run(call: Call) -> Tensor:
        kernel = call.head.kernels(call.aggregation)[which]
        options = dict(causal=call.causal, inverse=call.inverse, key_mask=call.key_mask)
        return kernel(call.q, call.k, call.v, call.algebra, **options, chunk_size=call.chunk_size)

    return run


PATHS: tuple[Path, ...] = (
    Path(
        "reference",
        (_asked_for,),
        _run(1),
        "tests/test_rotor_attention.py::test_matches_clifford_package",
    ),
    Path(
        "fast",
        (),  # every head has a fast kernel (its own reference where it names none)
        _run(0),
        "tests/test_rotor_attention.py::test_reference_equals_auto_values_and_gradients",
    ),
)
BACKENDS = table.backends(PATHS)


def choose(call: Call) -> Path:
    """The row that runs ``call`` (`geoattn.attention.dispatch.choose` over `PATHS`)."""
    return table.choose(PATHS, call, "rotor_attention")


def explain(call: Call) -> list[tuple[str, tuple[str, ...]]]:
    """Every row's reasons for ``call``: ``[(name, reasons)]`` in priority order, ``()`` where it serves."""
    return table.explain(PATHS, call)
