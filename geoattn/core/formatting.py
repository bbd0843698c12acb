"""Plain-text output shared by the command line, the benchmarks and the experiment reports."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (readable in a terminal, pasteable into BENCHMARKS.md)."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    sep = "| " + " | ".join("-" * w for w in widths) + " |"
    return "\n".join([line(list(headers)), sep, *(line(r) for r in cells)])


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def significant(value: float, digits: int = 4) -> str:
    """``value`` with ``digits`` significant digits (plain or scientific, whichever is shorter)."""
    return f"{value:#.{digits}g}".rstrip(".")
