"""The one place that chooses how `rt_attention` runs (PyTorch SDPA's backend list, xformers' fmha
operator list): `PATHS`, in priority order, rows of `geoattn.attention.dispatch.Path`.
``backend="auto"`` takes the first row none of whose checks declines; a backend named explicitly
runs the call or raises a ValueError with all its reasons; `explain` lists every row's reasons. The
checks read static facts only (device, dtype, shapes, which tensors require gradients, whether
positions were given or weights asked for), never a tensor's values, and build nothing: they run
under ``torch.compile(fullgraph=True)`` and cost no device sync. Each row names the test that holds
it to the reference.

Why these rows (BENCHMARKS.md, "RT-Filter attention" and "Language models"): on the CPU the native
kernel serves every parameter structure faster than each Python path it replaced (SDPA with folded
keys, the tied SDPA chunks, the dense tile, the blockwise loops) at every measured length; on a GPU
FlexAttention is the fused form of the Δt-dependent precision; the chunked path covers the rest
exactly; the reference is the oracle.
"""

from __future__ import annotations

from geoattn.attention import dispatch as table
from geoattn.attention.dispatch import Path, no_weights
from geoattn.attention.rt import chunked, flex, native_cpu, reference
from geoattn.attention.rt.params import Call


def _asked_for(call: Call) -> str | None:
    if call.backend == "reference" or call.return_weights:
        return None
    return "it materialises the N × N weights: only on request (backend='reference' or return_weights)"


PATHS: tuple[Path, ...] = (
    Path(
        "reference",
        (_asked_for,),
        reference.run,
        "tests/test_rt_attention.py::test_hand_built_case_matches_the_formula",
    ),
    Path(
        "native",
        (*native_cpu.CHECKS, no_weights),
        native_cpu.run,
        "tests/test_native.py::test_native_path_matches_reference",
    ),
    Path(
        "flex",
        (*flex.CHECKS, no_weights),
        flex.run,
        "tests/test_rt_flex.py::test_compiled_flex_matches_reference",
    ),
    Path(
        "chunked",
        (no_weights,),  # any device, dtype, times and ω
        chunked.run,
        "tests/test_rt_attention.py::test_chunked_path_matches_reference",
    ),
)

NAMES = tuple(p.name for p in PATHS)
BACKENDS = table.backends(PATHS)


def choose(call: Call) -> Path:
    """The row that runs ``call`` (`geoattn.attention.dispatch.choose` over `PATHS`)."""
    return table.choose(PATHS, call, "rt_attention")


def explain(call: Call) -> list[tuple[str, tuple[str, ...]]]:
    """Every row's reasons for ``call``: ``[(name, reasons)]`` in priority order, ``()`` where it serves."""
    return table.explain(PATHS, call)
