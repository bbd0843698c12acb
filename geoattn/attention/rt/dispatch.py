"""The one place that chooses how `rt_attention` runs (PyTorch SDPA's backend list, xformers' fmha
operator list): `PATHS`, in priority order. ``backend="auto"`` takes the first row whose ``can_use``
returns None; a backend named explicitly must accept the call or raises a ValueError with its
reason. ``can_use`` reads static facts only (device, dtype, shapes, which tensors require gradients,
whether positions were given), never a tensor's values: it runs under ``torch.compile(fullgraph=True)``
and costs no device sync. Each row names the test that holds it to the reference.

Why these rows (BENCHMARKS.md, "RT-Filter attention" and "Language models"): on the CPU the native
kernel serves every parameter structure faster than each Python path it replaced (SDPA with folded
keys, the tied SDPA chunks, the dense tile, the blockwise loops) at every measured length; on a GPU
FlexAttention is the fused form of the Δt-dependent precision; the chunked path covers the rest
exactly; the reference is the oracle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor

from geoattn.attention.rt import chunked, flex, native_cpu, reference
from geoattn.attention.rt.params import Call


class Path(NamedTuple):
    """One row of the table."""

    name: str
    can_use: Callable[[Call], str | None]  # None: it serves the call; else the reason it does not
    run: Callable[[Call], tuple[Tensor, Tensor | None]]  # -> (o (B, H, N, D), weights or None)
    test: str  # the test that holds it to the reference, values and gradients


def _reference_can_use(call: Call) -> str | None:
    if call.backend == "reference" or call.return_weights:
        return None
    return "it materialises the N × N weights: only on request (backend='reference' or return_weights)"


def _chunked_can_use(call: Call) -> str | None:
    return None  # any device, dtype, times and ω


PATHS: tuple[Path, ...] = (
    Path(
        "reference",
        _reference_can_use,
        reference.run,
        "tests/test_rt_attention.py::test_hand_built_case_matches_the_formula",
    ),
    Path(
        "native",
        native_cpu.can_use,
        native_cpu.run,
        "tests/test_native.py::test_native_path_matches_reference",
    ),
    Path("flex", flex.can_use, flex.run, "tests/test_rt_flex.py::test_compiled_flex_matches_reference"),
    Path(
        "chunked",
        _chunked_can_use,
        chunked.run,
        "tests/test_rt_attention.py::test_chunked_path_matches_reference",
    ),
)

NAMES = tuple(p.name for p in PATHS)
BACKENDS = ("auto", *NAMES)


def choose(call: Call) -> Path:
    """The path that runs ``call``: the first row that accepts it under ``backend="auto"``, else the
    row named by ``call.backend`` (a ValueError if it declines)."""
    if call.return_weights:  # weights are N × N by definition: only the reference has them
        return PATHS[0]
    if call.backend == "auto":
        for path in PATHS:
            if path.can_use(call) is None:
                return path
        raise AssertionError("the chunked row accepts every call")
    for path in PATHS:
        if path.name == call.backend:
            reason = path.can_use(call)
            if reason is not None:
                raise ValueError(f"backend={call.backend!r} cannot run this call: {reason}")
            return path
    raise ValueError(f"backend must be one of {BACKENDS}, got {call.backend!r}")


def explain(call: Call) -> list[tuple[str, str | None]]:
    """Every row's answer for ``call``: ``[(name, None | reason)]``, in priority order."""
    return [(path.name, path.can_use(call)) for path in PATHS]
