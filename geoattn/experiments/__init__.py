"""Experiments: a grid of runs (cells × seeds) defined in ``experiments/NAME.toml``, run resumably,
then aggregated into ``results/NAME.md`` and ``results/NAME_*.png`` (``geoattn experiment NAME``).

spec.py     the experiment file: base settings, cells, seeds, metrics, comparisons, plots
runner.py   plan (what is done, what resumes, what is new) and execution (in process or parallel)
report.py   mean ± std per cell, every seed's number, verdicts by Welch's t-test, plots; a
            confirmation's Holm-adjusted family and its NAME.json
ledger.py   the confirmations' ledger (results/ledger.jsonl): recorded before the first test read,
            refusing a changed protocol or data another confirmation read
"""

from geoattn.experiments.report import (
    Comparison,
    aggregate,
    check_confirmations,
    holm,
    rewrite_verdicts,
    verdict,
    welch,
    welch_interval,
    write_report,
)
from geoattn.experiments.runner import RunPlan, check_devices, execute, plan
from geoattn.experiments.spec import ExperimentSpec, load_spec

__all__ = [
    "check_devices",
    "ExperimentSpec",
    "load_spec",
    "RunPlan",
    "plan",
    "execute",
    "Comparison",
    "aggregate",
    "verdict",
    "welch",
    "welch_interval",
    "holm",
    "check_confirmations",
    "rewrite_verdicts",
    "write_report",
]
