"""Aggregating an experiment: mean ± std over seeds per cell, every seed's number, verdicts, plots.

The verdict rule (stated in every report): Welch's t-test, two-sided. With the sample standard
deviations ``s`` (n − 1 in the denominator), ``SE = sqrt(s_a²/n_a + s_b²/n_b)``, ``t = (mean_a −
mean_b) / SE`` and the Welch–Satterthwaite degrees of freedom
``df = SE⁴ / ((s_a²/n_a)²/(n_a − 1) + (s_b²/n_b)²/(n_b − 1))``, a difference is called real only when
``p < 0.05``. At two or three seeds a side df is 1–4, where the critical |t| is 2.8–12.7, not 2.
With one seed on a side, or no spread on either side (t undefined), there is no verdict.

A confirmatory experiment's report (``confirm = true``) reads its comparisons as one family: each
effect a − b (and relative to b's mean) with its 95 % Welch confidence interval, Welch's p, and Holm's
adjusted p over the experiment's comparisons; "confirmed" only where the adjusted p < ``alpha``. Beside
it ``results/NAME.json`` (:func:`write_summary`) holds the same numbers for README's results table.
"""

from __future__ import annotations

import json
import math
import platform
import re
import statistics
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from geoattn.core.errors import CheckpointError, ConfigError
from geoattn.core.formatting import format_table, significant
from geoattn.experiments import ledger
from geoattn.experiments.runner import RunPlan, evaluation_file, sets_read
from geoattn.experiments.spec import ExperimentSpec
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


def holm(ps: list[float]) -> list[float]:
    """Holm's step-down adjustment of ``ps`` (one family), in their order: the i-th smallest p times
    (m − i + 1), made non-decreasing, capped at 1. A NaN p (no test) counts in m as p = 1 and stays NaN.

    Example: ``[0.01, 0.04, 0.03] -> [0.03, 0.06, 0.06]``."""
    m = len(ps)
    order = sorted(range(m), key=lambda i: 1.0 if math.isnan(ps[i]) else ps[i])
    adjusted, running = [math.nan] * m, 0.0
    for rank, i in enumerate(order):
        p = 1.0 if math.isnan(ps[i]) else ps[i]
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = math.nan if math.isnan(ps[i]) else running
    return adjusted


def welch_interval(a: list[float], b: list[float], level: float = 0.95) -> tuple[float, float]:
    """The ``level`` confidence interval of mean_a − mean_b under Welch's t (Welch–Satterthwaite df):
    ``diff ± t_{(1+level)/2, df} · SE``; NaNs where the test is undefined (see :func:`welch`)."""
    from scipy.stats import t as student_t

    diff, se, _, df, _ = welch(a, b)
    if math.isnan(df):
        return math.nan, math.nan
    half = float(student_t.ppf((1 + level) / 2, df)) * se
    return diff - half, diff + half


@dataclass
class Confirmed:
    """One declared comparison of a confirmation, read under the family's Holm adjustment."""

    a: str
    b: str
    metric: str
    n_a: int
    n_b: int
    effect: float  # mean_a − mean_b
    relative: float  # effect / mean_b
    ci95: tuple[float, float]
    df: float
    p: float
    p_holm: float
    confirmed: bool
    verdict: str


def confirm(spec: ExperimentSpec, table: dict[str, dict[str, Stat]]) -> list[Confirmed]:
    """Every ``[[compare]]`` of a confirmatory ``spec`` on ``table`` (:func:`aggregate`), adjusted
    together (Holm) and called at ``spec.alpha``."""
    rows = [compare(table, e["a"], e["b"], e["metric"]) for e in spec.compare]
    adjusted = holm([c.p for c in rows])
    out = []
    for c, p_holm in zip(rows, adjusted):
        a, b = table[c.a].get(c.metric, Stat([])), table[c.b].get(c.metric, Stat([]))
        relative = c.diff / b.mean if b.mean else math.nan
        confirmed = p_holm < spec.alpha
        if math.isnan(p_holm):
            word = "no test (fewer than two seeds, or no spread, on a side): not confirmed"
        elif not confirmed:
            word = f"not confirmed (Holm p ≥ {spec.alpha:g})"
        else:
            if c.metric in spec.descriptive:
                direction = "higher" if c.diff > 0 else "lower"
            else:
                direction = "better" if (c.diff > 0) == (c.metric in spec.higher_is_better) else "worse"
            word = f"confirmed: {c.a} is {direction} (Holm p < {spec.alpha:g})"
        ci = welch_interval(a.values, b.values)
        out.append(
            Confirmed(
                c.a, c.b, c.metric, c.n_a, c.n_b, c.diff, relative, ci, c.df, c.p, p_holm, confirmed, word
            )
        )
    return out


def confirmation_rule(spec: ExperimentSpec) -> str:
    """The paragraph that says how a confirmatory report reads its comparisons (effect, interval, Holm)."""
    return (
        f"The comparisons below ({len(spec.compare)}) were declared before the first test read and are read "
        "as one family: each effect is mean_a − mean_b over seeds (relative: ÷ mean_b) with its 95 % "
        "confidence interval under Welch's t (diff ± t₀.₉₇₅,df · SE, Welch–Satterthwaite df), Welch's "
        f'two-sided p, and Holm\'s adjusted p over the family; "confirmed" only where the adjusted p < '
        f"{spec.alpha:g}."
    )


def _confirmation_lines(spec: ExperimentSpec, table: dict[str, dict[str, Stat]], entry) -> list[str]:
    """The report's "Confirmation" section: the claim, the rule, the ledger entry, one row a comparison."""
    rows = []
    for c in confirm(spec, table):
        low, high = c.ci95
        rows.append(
            [
                f"{c.a} − {c.b}",
                c.metric,
                f"{c.n_a}, {c.n_b}",
                f"{c.effect:+.4g}",
                "–" if math.isnan(c.relative) else f"{100 * c.relative:+.1f} %",
                "–" if math.isnan(low) else f"[{low:+.4g}, {high:+.4g}]",
                "–" if math.isnan(c.p) else _p(c.p),
                "–" if math.isnan(c.p_holm) else _p(c.p_holm),
                c.verdict,
            ]
        )
    record = entry.record
    commit = (record.get("commit") or "")[:12] or "outside a git checkout"
    dirty = " (with uncommitted changes)" if record.get("dirty") else ""
    lines = ["## Confirmation", "", f"Claim: {spec.claim.strip()}", "", confirmation_rule(spec), ""]
    lines += [
        f"Recorded before its first test read in `{ledger.LEDGER}` (line {entry.line}): spec sha256 "
        f"{record['spec_sha256'][:12]}, code {commit}{dirty}, data {_data_text(record['data'])}, "
        f"at {record.get('time')}.",
        "",
        format_table(
            ["comparison", "metric", "n", "effect", "relative", "95 % CI", "p", "Holm p", "verdict"], rows
        ),
        "",
    ]
    if spec.conclusion:
        lines += ["## Reading", "", spec.conclusion.strip(), ""]
    return lines


def _data_text(identity: dict[str, Any]) -> str:
    if "generator" in identity:
        g = identity["generator"]
        return f"generator {g['name']} version {g['version']} seed {g['seed']} (task.{g['option']})"
    return ", ".join(f"{name} ({digest[:12]})" for name, digest in identity.get("files", {}).items())


def _json_number(x: float) -> float | None:
    return None if isinstance(x, float) and math.isnan(x) else x


def write_summary(spec: ExperimentSpec, table: dict[str, dict[str, Stat]], report: Path, entry) -> Path:
    """``NAME.json`` beside the report: the claim, data, each comparison's effect, CI, p, Holm p and
    verdict, and the ledger entry, so README's results table is built from confirmations only."""
    comparisons = []
    for c in confirm(spec, table):
        row = {k: _json_number(v) for k, v in asdict(c).items() if k != "ci95"}
        row["ci95"] = [_json_number(v) for v in c.ci95]
        comparisons.append(row)
    summary = {
        "experiment": spec.name,
        "claim": spec.claim.strip(),
        "report": report.as_posix(),
        "spec": spec.path.as_posix(),
        "data": entry.record["data"],
        "alpha": spec.alpha,
        "seeds": list(spec.seeds),
        "ledger": {
            "line": entry.line,
            "spec_sha256": entry.record["spec_sha256"],
            "commit": entry.record.get("commit"),
            "dirty": entry.record.get("dirty"),
        },
        "comparisons": comparisons,
        "confirmed": all(c["confirmed"] for c in comparisons),
    }
    path = report.with_suffix(".json")
    path.write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def check_confirmations(results: Path) -> list[str]:
    """What is missing behind the confirmations' summaries (``results/**/NAME.json``): each must have
    its report and a ledger entry of its experiment with its spec hash. Empty when all is in place."""
    entries = ledger.read_ledger(results / ledger.LEDGER)
    problems = []
    for path in sorted(results.rglob("*.json")):
        summary = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(summary, dict) or "comparisons" not in summary or "claim" not in summary:
            continue
        if not path.with_suffix(".md").is_file():
            problems.append(f"{path}: no report {path.with_suffix('.md')}")
        digest = summary.get("ledger", {}).get("spec_sha256")
        if not any(
            e.record.get("experiment") == summary.get("experiment") and e.record.get("spec_sha256") == digest
            for e in entries
        ):
            problems.append(
                f"{path}: no entry of {summary.get('experiment')!r} with its spec hash in the ledger"
            )
    return problems


LEGACY = (
    "**Read before the protocol (legacy).** This experiment names test metrics ({metrics}) that were "
    "read while exploring: recipes changed between reads and seeds were added after looking, with no "
    "correction for multiple comparisons. Its numbers are the exploratory record, not a confirmation "
    "(those are `confirm = true` experiments, recorded in results/ledger.jsonl); it is reported, not run "
    "again."
)


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
    """``results/NAME.md`` (tables, verdicts, every seed) and ``results/NAME_*.png`` (a probe's under
    ``results/probes/``); a confirmation's "Confirmation" section and ``NAME.json`` (its ledger entry
    must be recorded: ProtocolError otherwise); returns the .md."""
    import torch

    from geoattn.bench.common import cpu_isa, cpu_model

    entry = _ledger_entry(spec, results)
    folder = results / spec.folder
    folder.mkdir(parents=True, exist_ok=True)
    table = aggregate(spec, plans)
    finished = sum(1 for p in plans if run_values(p.out).get("iter") == p.config["max_iters"])
    lines = [f"# Experiment `{spec.name}`", ""]
    if spec.description:
        lines += [spec.description.strip(), ""]
    lines += [
        f"Command: `geoattn experiment {spec.name}` (definition: `{spec.path.as_posix()}`; runs in "
        + (
            f"`{spec.runs_root(runs).as_posix()}/`, its own). "
            if spec.confirm
            else f"`{runs.as_posix()}/`, shared with other experiments where the settings agree). "
        )
        + f"{finished} of {len(plans)} runs finished; seeds {spec.seeds}.",
        f"Written {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.machine()} ({cpu_model()}, "
        f"{cpu_isa()}), {_cpus()} CPU cores, torch {torch.__version__}.",
        *data_read(plans),
        "",
        *([LEGACY.format(metrics=", ".join(spec.test_metrics)), ""] if spec.legacy else []),
        "## Mean ± std over seeds",
        "",
        format_table(
            ["cell", *spec.metrics],
            [[c.name, *(str(table[c.name].get(m, Stat([]))) for m in spec.metrics)] for c in spec.cells],
        ),
        "",
    ]
    lines += _confirmation_lines(spec, table, entry) if entry else _verdicts_and_reading(spec, table)
    for plot in spec.plots:
        name = f"{spec.name}_{re.sub(r'[^A-Za-z0-9]+', '_', plot['metric']).strip('_')}.png"
        _plot(spec, table, plot, folder / name)
        lines += [f"![{plot['metric']}]({name})", ""]
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
    path = folder / f"{spec.name}.md"
    path.write_text("\n".join(lines))
    if entry:
        write_summary(spec, table, path, entry)
    return path


def _ledger_entry(spec: ExperimentSpec, results: Path) -> ledger.Entry | None:
    """A confirmation's ledger entry (None for an exploratory spec); ProtocolError when it has none or
    the spec changed since (its report would read what no protocol declared)."""
    if not spec.confirm:
        return None
    path = results / ledger.LEDGER
    entry = ledger.recorded(spec, path)
    if entry is None:
        raise ledger.ProtocolError(
            f"{spec.name}: no confirmation of it is recorded in {path}: run it (geoattn experiment "
            f"{spec.name}) before its report is written"
        )
    return entry


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
    entry = _ledger_entry(spec, results)
    if entry:
        starts = [i for i, line in enumerate(lines) if line in ("## Confirmation", "## Reading")]
        start = starts[0] if starts else end
        lines[start:end] = [*_confirmation_lines(spec, table, entry)[:-1], note, ""]
        write_summary(spec, table, path, entry)
    else:
        lines[start:end] = _verdicts_and_reading(spec, table, note)
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)
