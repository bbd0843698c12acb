"""Aggregating an experiment: mean ± std over seeds per cell, every seed's number, verdicts, plots.

The verdict rule (stated in every report): a difference between two cells is called real only when
``|mean_a − mean_b| > 2 · SE``, ``SE = sqrt(s_a²/n_a + s_b²/n_b)`` with the sample standard
deviations ``s`` (n − 1 in the denominator); with fewer than two seeds on a side there is no verdict.
"""

from __future__ import annotations

import math
import platform
import re
import statistics
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from geoattn.experiments.runner import RunPlan
from geoattn.experiments.spec import ExperimentSpec
from geoattn.formatting import format_table, significant
from geoattn.training.run_dir import RunDirectory

VERDICT_RULE = (
    "A difference is called real only when |mean_a − mean_b| > 2 SE, SE = sqrt(s_a²/n_a + s_b²/n_b) "
    "(sample standard deviations over seeds); otherwise: no measurable difference."
)


def run_values(out: Path) -> dict[str, float]:
    """Every number a finished run reports: its summary (final metrics included) and evaluation rows."""
    run = RunDirectory(out)
    summary = run.read_summary()
    values = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    values.update({k: v for k, v in summary.get("final", {}).items() if isinstance(v, (int, float))})
    values.update(
        {r["metric"]: r["value"] for r in run.read_evaluation() if isinstance(r["value"], (int, float))}
    )
    return values


@dataclass
class Stat:
    """The numbers of one cell on one metric, one per finished seed."""

    values: list[float]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values) if self.values else math.nan

    @property
    def std(self) -> float:
        return statistics.stdev(self.values) if self.n > 1 else math.nan

    def __str__(self) -> str:
        if not self.values:
            return "–"
        if self.n == 1:
            return f"{significant(self.mean)} (n=1)"
        return f"{significant(self.mean)} ± {significant(self.std, 2)} (n={self.n})"


def aggregate(spec: ExperimentSpec, plans: list[RunPlan]) -> dict[str, dict[str, Stat]]:
    """``{cell: {metric: Stat}}`` over the finished runs (``metrics`` of the spec, plus every metric
    the plots need)."""
    table: dict[str, dict[str, Stat]] = {c.name: {} for c in spec.cells}
    for p in plans:
        values = run_values(p.out)
        if not values.get("iter") == p.config["max_iters"]:
            continue  # not finished: it does not count
        for metric, value in values.items():
            table[p.cell.name].setdefault(metric, Stat([])).values.append(float(value))
    return table


@dataclass
class Comparison:
    a: str
    b: str
    metric: str
    diff: float  # mean_a − mean_b
    se: float
    n_a: int
    n_b: int


def verdict(comparison: Comparison, higher_is_better: bool = False) -> str:
    """One sentence no stronger than the spread allows (see ``VERDICT_RULE``)."""
    c = comparison
    head = f"{c.a} − {c.b} on {c.metric}: {c.diff:+.4g}"
    if c.n_a < 2 or c.n_b < 2 or math.isnan(c.se):
        return f"{head} (n = {c.n_a}, {c.n_b}): too few seeds for a verdict."
    head += f" ± {c.se:.2g} (SE; n = {c.n_a}, {c.n_b})"
    if abs(c.diff) <= 2 * c.se:
        return f"{head}: no measurable difference (within 2 SE)."
    better = (c.diff > 0) == higher_is_better
    return f"{head}: {c.a} is {'better' if better else 'worse'} (beyond 2 SE)."


def compare(table: dict[str, dict[str, Stat]], a: str, b: str, metric: str) -> Comparison:
    sa, sb = table[a].get(metric, Stat([])), table[b].get(metric, Stat([]))
    se = math.sqrt(sa.std**2 / sa.n + sb.std**2 / sb.n) if sa.n > 1 and sb.n > 1 else math.nan
    return Comparison(a, b, metric, sa.mean - sb.mean, se, sa.n, sb.n)


def _curve_points(stats: dict[str, Stat], prefix: str) -> list[tuple[float, str]]:
    """Metrics ``PREFIX <number> ...`` sorted by the number (e.g. ``val_loss @ 128 (2×)``)."""
    points = []
    for metric in stats:
        if metric.startswith(prefix):
            found = re.search(r"[-+]?\d+(\.\d+)?", metric[len(prefix) :])
            if found:
                points.append((float(found.group()), metric))
    return sorted(points)


def _plot(spec: ExperimentSpec, table: dict[str, dict[str, Stat]], entry: dict[str, str], path: Path) -> Path:
    from geoattn.training.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    metric = entry["metric"]
    if entry["kind"] == "bar":
        names = [c.name for c in spec.cells]
        stats = [table[n].get(metric, Stat([])) for n in names]
        x = range(len(names))
        ax.bar(
            x, [s.mean for s in stats], yerr=[0 if s.n < 2 else s.std for s in stats], capsize=4, alpha=0.7
        )
        for i, s in zip(x, stats):
            ax.scatter([i] * s.n, s.values, color="k", s=10, zorder=3)
        ax.set_xticks(list(x), names, rotation=25, ha="right", fontsize=8)
        finite = [v for s in stats for v in s.values]
        if finite:
            low, high = min(finite), max(finite)
            pad = 0.15 * (high - low or abs(high) or 1.0)
            ax.set_ylim(low - pad, high + pad)
        ax.set(ylabel=metric, title=f"{spec.name}: {metric} (mean ± std, dots: seeds)")
    else:
        for cell in spec.cells:
            points = _curve_points(table[cell.name], metric)
            if not points:
                continue
            xs = [x for x, _ in points]
            stats = [table[cell.name][m] for _, m in points]
            ax.errorbar(
                xs,
                [s.mean for s in stats],
                yerr=[0 if s.n < 2 else s.std for s in stats],
                marker="o",
                capsize=3,
                label=cell.name,
            )
        ax.set_xscale("log", base=2)
        ax.set(xlabel=entry.get("xlabel", metric), ylabel=entry.get("ylabel", metric), title=f"{spec.name}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(spec: ExperimentSpec, plans: list[RunPlan], results: Path, runs: Path) -> Path:
    """``results/NAME.md`` (tables, verdicts, every seed) and ``results/NAME_*.png``; returns the .md."""
    import torch

    results.mkdir(parents=True, exist_ok=True)
    table = aggregate(spec, plans)
    finished = sum(1 for p in plans if run_values(p.out).get("iter") == p.config["max_iters"])
    lines = [f"# Experiment `{spec.name}`", ""]
    if spec.description:
        lines += [spec.description.strip(), ""]
    lines += [
        f"Command: `geoattn experiment {spec.name}` (definition: `{spec.path.as_posix()}`; runs in "
        f"`{runs.as_posix()}/`, shared with other experiments where the settings agree). "
        f"{finished} of {len(plans)} runs finished; seeds {spec.seeds}.",
        f"Written {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.machine()}, "
        f"{_cpus()} CPU cores, torch {torch.__version__}.",
        "",
        "## Mean ± std over seeds",
        "",
        format_table(
            ["cell", *spec.metrics],
            [[c.name, *(str(table[c.name].get(m, Stat([]))) for m in spec.metrics)] for c in spec.cells],
        ),
        "",
    ]
    if spec.compare:
        lines += ["## Verdicts", "", VERDICT_RULE, ""]
        for entry in spec.compare:
            comparison = compare(table, entry["a"], entry["b"], entry["metric"])
            lines.append(f"* {verdict(comparison, entry['metric'] in spec.higher_is_better)}")
        lines.append("")
    if spec.conclusion:
        lines += ["## Reading", "", spec.conclusion.strip(), ""]
    for entry in spec.plots:
        name = f"{spec.name}_{re.sub(r'[^A-Za-z0-9]+', '_', entry['metric']).strip('_')}.png"
        _plot(spec, table, entry, results / name)
        lines += [f"![{entry['metric']}]({name})", ""]
    per_seed = []
    for p in plans:
        values = run_values(p.out)
        per_seed.append(
            [p.cell.name, p.seed, *(significant(values[m]) if m in values else "–" for m in spec.metrics)]
        )
    lines += [
        "<details><summary>Every seed</summary>",
        "",
        format_table(["cell", "seed", *spec.metrics], per_seed),
        "",
        "</details>",
        "",
    ]
    path = results / f"{spec.name}.md"
    path.write_text("\n".join(lines))
    return path


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)
