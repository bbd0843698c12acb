"""Aggregating an experiment: mean ± std over seeds per cell, every seed's number, verdicts, plots.

The verdict rule (stated in every report): Welch's t-test, two-sided. With the sample standard
deviations ``s`` (n − 1 in the denominator), ``SE = sqrt(s_a²/n_a + s_b²/n_b)``, ``t = (mean_a −
mean_b) / SE`` and the Welch–Satterthwaite degrees of freedom
``df = SE⁴ / ((s_a²/n_a)²/(n_a − 1) + (s_b²/n_b)²/(n_b − 1))``, a difference is called real only when
``p < 0.05``. At two or three seeds a side df is 1–4, where the critical |t| is 2.8–12.7, not 2.
With one seed on a side, or no spread on either side (t undefined), there is no verdict.
"""

from __future__ import annotations

import math
import platform
import re
import statistics
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from geoattn.errors import CheckpointError, ConfigError
from geoattn.experiments.runner import RunPlan, evaluation_file, sets_read
from geoattn.experiments.spec import ExperimentSpec
from geoattn.formatting import format_table, significant
from geoattn.training.run_dir import RunDirectory

ALPHA = 0.05
VERDICT_RULE = (
    "Welch's t-test, two-sided: a difference is called real only when p < 0.05, with "
    "t = (mean_a − mean_b) / SE, SE = sqrt(s_a²/n_a + s_b²/n_b) (sample standard deviations over seeds) "
    "and the Welch–Satterthwaite degrees of freedom df = SE⁴ / ((s_a²/n_a)²/(n_a − 1) + "
    "(s_b²/n_b)²/(n_b − 1)); otherwise: no measurable difference. With one seed on a side, or no "
    "spread on either side, there is no test and no verdict."
)


def run_values(out: Path, evaluation: str = RunDirectory.EVALUATION) -> dict[str, float]:
    """Every number a finished run reports: its summary (final metrics included) and the evaluation
    rows of its file ``evaluation`` (a peer's: :func:`~geoattn.experiments.runner.evaluation_file`)."""
    run = RunDirectory(out)
    summary = run.read_summary()
    values = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    values.update({k: v for k, v in summary.get("final", {}).items() if isinstance(v, (int, float))})
    rows = run.read_evaluation(evaluation)
    values.update({r["metric"]: r["value"] for r in rows if isinstance(r["value"], (int, float))})
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
        values = run_values(p.out, evaluation_file(p.config))
        if not values.get("iter") == p.config["max_iters"]:
            continue  # not finished: it does not count
        for metric, value in values.items():
            table[p.cell.name].setdefault(metric, Stat([])).values.append(float(value))
    return table


@dataclass
class Comparison:
    """Cell a against cell b on one metric, with Welch's t-test (NaN where it is undefined)."""

    a: str
    b: str
    metric: str
    diff: float  # mean_a − mean_b
    se: float
    n_a: int
    n_b: int
    t: float = math.nan
    df: float = math.nan
    p: float = math.nan


def welch(a: list[float], b: list[float]) -> tuple[float, float, float, float, float]:
    """Welch's two-sided t-test of two samples: ``(mean_a − mean_b, SE, t, df, p)``.

    NaN for SE, t, df and p when a side has fewer than two values; SE = 0 and NaN t, df, p when
    neither side has any spread (the test is undefined there)."""
    n_a, n_b = len(a), len(b)
    diff = (statistics.fmean(a) if a else math.nan) - (statistics.fmean(b) if b else math.nan)
    if n_a < 2 or n_b < 2:
        return diff, math.nan, math.nan, math.nan, math.nan
    va, vb = statistics.variance(a) / n_a, statistics.variance(b) / n_b
    se = math.sqrt(va + vb)
    if se == 0:
        return diff, 0.0, math.nan, math.nan, math.nan
    df = (va + vb) ** 2 / (va**2 / (n_a - 1) + vb**2 / (n_b - 1))
    t = diff / se
    return diff, se, t, df, two_sided_p(t, df)


def two_sided_p(t: float, df: float) -> float:
    """``P(|T| ≥ |t|)`` for Student's t with ``df`` (real, > 0) degrees of freedom."""
    from scipy.stats import t as student_t

    return float(2 * student_t.sf(abs(t), df))


def verdict(comparison: Comparison, higher_is_better: bool = False, descriptive: bool = False) -> str:
    """One sentence no stronger than Welch's test allows (see ``VERDICT_RULE``); a ``descriptive``
    metric (one that measures, not scores) is called higher or lower, not better or worse."""
    c = comparison
    head = f"{c.a} − {c.b} on {c.metric}: {c.diff:+.4g}"
    if c.n_a < 2 or c.n_b < 2 or math.isnan(c.se):
        return f"{head} (n = {c.n_a}, {c.n_b}): too few seeds for a test (one seed on a side): no verdict."
    if c.se == 0:
        return f"{head} (n = {c.n_a}, {c.n_b}): no spread on either side, so no test: " + (
            "identical values." if c.diff == 0 else "no verdict."
        )
    head += f" ± {c.se:.2g} (SE; n = {c.n_a}, {c.n_b}; Welch t = {c.t:+.2f}, df = {c.df:.1f}, p = {_p(c.p)})"
    if not c.p < ALPHA:
        return f"{head}: no measurable difference (p ≥ {ALPHA:g})."
    if descriptive:
        word = "higher" if c.diff > 0 else "lower"
    else:
        word = "better" if (c.diff > 0) == higher_is_better else "worse"
    return f"{head}: {c.a} is {word} (p < {ALPHA:g})."


def _p(p: float) -> str:
    return f"{p:.2g}" if p >= 1e-4 else f"{p:.1e}"


def compare(table: dict[str, dict[str, Stat]], a: str, b: str, metric: str) -> Comparison:
    sa, sb = table[a].get(metric, Stat([])), table[b].get(metric, Stat([]))
    diff, se, t, df, p = welch(sa.values, sb.values)
    return Comparison(a, b, metric, diff, se, sa.n, sb.n, t, df, p)


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
    from geoattn.training.plots import pyplot, save_figure

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
    return save_figure(fig, path)


def write_report(spec: ExperimentSpec, plans: list[RunPlan], results: Path, runs: Path) -> Path:
    """``results/NAME.md`` (tables, verdicts, every seed) and ``results/NAME_*.png``; returns the .md."""
    import torch

    from geoattn.bench.common import cpu_isa, cpu_model

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
        f"Written {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.machine()} ({cpu_model()}, "
        f"{cpu_isa()}), {_cpus()} CPU cores, torch {torch.__version__}.",
        *data_read(plans),
        "",
        "## Mean ± std over seeds",
        "",
        format_table(
            ["cell", *spec.metrics],
            [[c.name, *(str(table[c.name].get(m, Stat([]))) for m in spec.metrics)] for c in spec.cells],
        ),
        "",
    ]
    lines += _verdicts_and_reading(spec, table)
    for entry in spec.plots:
        name = f"{spec.name}_{re.sub(r'[^A-Za-z0-9]+', '_', entry['metric']).strip('_')}.png"
        _plot(spec, table, entry, results / name)
        lines += [f"![{entry['metric']}]({name})", ""]
    per_seed = []
    for p in plans:
        values = run_values(p.out, evaluation_file(p.config))
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


def data_read(plans: list[RunPlan]) -> list[str]:
    """The report's line on which data its runs read, where the task records it (the n-body task: the
    sha256 of each set's samples, in a run's ``config.json`` and in a peer's evaluation file): the
    hashes when every run that records them read the same sets, else a warning naming which runs
    read which (a comparison across different files is no comparison). Empty when no run records any.
    """
    groups: dict[tuple[tuple[str, str], ...], list[str]] = {}
    for p in plans:
        run = RunDirectory(p.out)
        if "command" in p.config:
            sets = run.read_evaluation_sets(evaluation_file(p.config))
        else:
            try:
                sets = sets_read(run.read_config().get("task", {}))
            except CheckpointError:  # no run there yet, or not one of ours: it records nothing
                sets = {}
        if sets:
            groups.setdefault(tuple(sorted(sets.items())), []).append(f"{p.cell.name} (seed {p.seed})")
    if not groups:
        return []

    def hashes(key: tuple[tuple[str, str], ...]) -> str:
        return ", ".join(f"{name} {digest[:12]}" for name, digest in key)

    counted = sum(len(runs) for runs in groups.values())
    if len(groups) == 1:
        (key,) = groups
        return [
            f"Data: the {counted} runs that record it read the same sets (sha256 of the samples, "
            f"first 12 hex digits): {hashes(key)}."
        ]
    parts = "; ".join(f"{hashes(key)}: {', '.join(runs)}" for key, runs in groups.items())
    return [
        "**Data: the runs did not all read the same sets** (sha256 of the samples, first 12 hex digits): "
        f"{parts}."
    ]


def _verdicts_and_reading(
    spec: ExperimentSpec, table: dict[str, dict[str, Stat]], note: str = ""
) -> list[str]:
    """The report's "Verdicts" (one line per ``[[compare]]``) and "Reading" (the conclusion) sections."""
    lines = []
    if spec.compare:
        lines += ["## Verdicts", "", VERDICT_RULE + (f" {note}" if note else ""), ""]
        for entry in spec.compare:
            comparison = compare(table, entry["a"], entry["b"], entry["metric"])
            metric = entry["metric"]
            line = verdict(comparison, metric in spec.higher_is_better, metric in spec.descriptive)
            lines.append(f"* {line}")
        lines.append("")
    if spec.conclusion:
        lines += ["## Reading", "", spec.conclusion.strip(), ""]
    return lines


EVERY_SEED = "<details><summary>Every seed</summary>"


def read_every_seed(path: Path) -> dict[str, dict[str, Stat]]:
    """``{cell: {metric: Stat}}`` from the "Every seed" table of a written report (``–`` cells skipped).

    The table's numbers carry four significant digits, so statistics recomputed from it can differ
    from the runs' in the last digits."""
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    if EVERY_SEED not in text:
        raise ConfigError(f"{path} has no 'Every seed' table to recompute the verdicts from")
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in text.split(EVERY_SEED, 1)[1].split("</details>", 1)[0].splitlines()
        if line.startswith("|")
    ]
    if len(rows) < 2 or rows[0][:2] != ["cell", "seed"]:
        raise ConfigError(f"{path}: the 'Every seed' table does not start with the columns cell, seed")
    header, table = rows[0], {}
    for row in rows[2:]:  # rows[1] is the |---| line
        for metric, value in zip(header[2:], row[2:]):
            if value not in ("–", ""):
                table.setdefault(row[0], {}).setdefault(metric, Stat([])).values.append(float(value))
    return table


def rewrite_verdicts(spec: ExperimentSpec, results: Path) -> Path:
    """Rewrite the "Verdicts" and "Reading" sections of ``results/NAME.md`` from its own "Every seed"
    table (the runs need not be on this machine) and the spec's ``[[compare]]`` and conclusion; the
    rest of the report is left as it is. Returns the path."""
    path = results / f"{spec.name}.md"
    table = read_every_seed(path)
    for entry in spec.compare:
        for side in ("a", "b"):
            table.setdefault(entry[side], {})
    lines = path.read_text(encoding="utf-8").split("\n")
    starts = [i for i, line in enumerate(lines) if line in ("## Verdicts", "## Reading")]
    end = next(i for i, line in enumerate(lines) if line.startswith("![") or line == EVERY_SEED)
    start = starts[0] if starts else end
    note = "(Recomputed from the every-seed table below, four significant digits per value.)"
    lines[start:end] = _verdicts_and_reading(spec, table, note)
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)
