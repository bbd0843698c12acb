"""The experiment file (``experiments/NAME.toml``): what to run and what to report.

Example::

    description = "Which LM wins at nanoGPT's CPU recipe?"
    conclusion = "..."                           # the reading, written after looking at the numbers
    seeds = [1, 2, 3]
    metrics = ["val_loss_full", "wall_s"]        # keys of each run's summary / evaluation
    higher_is_better = ["accuracy"]              # verdicts: higher is better (default: lower is)
    descriptive = ["key_norm_ratio"]             # verdicts say higher / lower, not better / worse
    evaluate = true                              # also store the task's evaluation table per run

    [base]                                       # TrainConfig fields shared by every cell
    task = "lm"
    data = "../shared/data/tinyshakespeare.txt"
    max_iters = 2000

    [[cells]]                                    # one column of the grid: a name and its fields
    name = "transformer"
    model = "transformer"

    [[cells]]
    name = "rt, no process noise"
    model = "rt"
    model_options = { process_noise = false }

    [[compare]]                                  # a verdict: a against b on a metric
    a = "rt, no process noise"
    b = "transformer"
    metric = "val_loss_full"

    [[plots]]                                    # "bar" of one metric, or "curve" of metrics
    kind = "bar"                                 # sharing a prefix (e.g. the context lengths)
    metric = "val_loss_full"

Cells' fields are TrainConfig fields (``model_options`` / ``task_options`` tables merge with the
base's); each model's recipe (``Task.recipes``) sits below them, as on the command line. TOML has no
null: a field set to ``"none"`` takes its own default (e.g. ``min_lr``), and an option set to
``"default"`` is taken out of the merged table, so the model's own default applies instead of the
recipe's (how the cells of an experiment keep the model they ran when a recipe gains an option: their
run directories stay where they were).

A *peer* cell runs another project's own code instead of ``geoattn train``: ``command`` (a list of
arguments, run from the working directory) and ``max_iters`` (its budget in steps, for the report)::

    [[cells]]
    name = "EGNN (its own main_nbody.py)"
    max_iters = 3000
    command = ["{python}", "benchmarks/egnn_nbody.py", "--egnn", "{peers}/egnn", "--data", "{data}",
               "--seed", "{seed}", "--out", "{out}", "--threads", "{threads}"]

``{seed}``, ``{out}`` (the run directory), ``{data}`` (the base's ``data``), ``{threads}``,
``{python}`` (the interpreter running the experiment) and ``{peers}`` (``$GEOATTN_PEERS``, default
``../peers``: where the peers' checkouts and environments live) are filled in. The command writes
``{out}/metrics.json`` (a flat object of numbers); the runner records it as the run's final metrics.
It may also write ``{out}/predictions.npz`` (what its model predicted, an array per set): an experiment
with ``evaluate = true`` measures those as it measures this project's runs (the task's
``prediction_rows``, on the base's ``task``, ``data`` and ``task_options``), so a peer's row gets the same
per-sample columns.

A peer cell that several experiments report (the same runs, read by each) is written once, in
``peers.toml`` beside the experiment files, under an id, and named by it::

    # experiments/peers.toml
    [egnn-charged-4260]
    name = "EGNN (its own code), lr 2e-3"
    max_iters = 4260
    command = ["{python}", "benchmarks/egnn_nbody.py", ...]

    # experiments/nbody-cgenn.toml
    [[cells]]
    peer = "egnn-charged-4260"

A run's directory is keyed by the cell's name, command, budget and the base's ``data``, so every
experiment naming the peer on the same files shares its runs.

Exploration and confirmation. An experiment is *exploratory* by default: its runs read validation
only (the task's ``test_sets`` are sealed, :meth:`geoattn.tasks.base.Task.readable`), and it may not
name a test metric (``test_mse``, ``eval_mse``: a metric of a set in ``test_sets``) in ``metrics``,
``[[compare]]`` or ``[[plots]]``. Such a spec written before this protocol is *legacy*: its report is
the record of numbers read while exploring (adaptively, uncorrected), marked so; the command line
reports it but runs nothing new for it. A *confirmatory* experiment declares, before its first run,
what it will read and test::

    confirm = true
    claim = "The rotor recipe predicts GATr's n-body test set better than the Clifford recipe."
    seeds = [11, 12, 13, 14, 15]                 # n >= 5, fixed: adding seeds later is refused
    alpha = 0.05                                 # "confirmed": Holm-adjusted p < alpha
    data_sha256 = { "data/nbody/test.npz" = "3f5c..." }   # the held-out files it reads, or:
    # data_generator = { name = "pointcloud", version = "1", seed = 9001, option = "seed" }

    [[compare]]                                  # its primary comparisons (at least one)
    a = "rotor"
    b = "clifford"
    metric = "test_mse"

Its runs live apart (``RUNS/confirmations/NAME/``) and read the test sets; the runner records the
spec's hash, the data, the code's commit, cells and seeds in ``results/ledger.jsonl`` before the first
test read and refuses a changed spec or data another confirmation has read
(:mod:`geoattn.experiments.ledger`). A generator's ``option`` (default ``seed``) is the ``task.*`` key
that must hold its ``seed`` in every cell.

Experiments live in ``experiments/NAME.toml`` (their report in ``results/NAME.md``) or, for the probes
that led to a result, ``experiments/probes/NAME.toml`` (report in ``results/probes/NAME.md``).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geoattn.bench.common import peers_dir
from geoattn.core.errors import ConfigError
from geoattn.core.settings import read_toml
from geoattn.training.config import FIELDS, TrainConfig
from geoattn.training.recipes import build_config

EXPERIMENTS_DIR = Path("experiments")
PROBES = "probes"  # experiments/probes/NAME.toml, reported in results/probes/NAME.md
PEERS_FILE = "peers.toml"  # the named peer cells, beside the experiment files (not an experiment)
PLOT_KINDS = ("bar", "curve")
TOP_KEYS = {
    "description",
    "conclusion",
    "seeds",
    "metrics",
    "higher_is_better",
    "descriptive",
    "evaluate",
    "base",
    "cells",
    "compare",
    "plots",
    "confirm",
    "claim",
    "alpha",
    "data_sha256",
    "data_generator",
}
MIN_CONFIRM_SEEDS = 5
GENERATOR_KEYS = {"name", "version", "seed", "option"}


def is_test_metric(metric: str, test_sets: tuple[str, ...]) -> bool:
    """Whether ``metric`` (or a curve's metric prefix) is measured on one of ``test_sets``: named
    ``SET`` or ``SET_...`` (``test_mse``, ``test_mse_last``, ``eval_mse``), or a baseline of one."""
    name = metric.removeprefix("baseline_")
    return any(name == s or name.startswith(f"{s}_") for s in test_sets)


@dataclass
class Cell:
    """One setting of the grid: a name (a row of the report) and its TrainConfig fields, or a peer's
    ``command`` (see the module docstring)."""

    name: str
    fields: dict[str, Any]
    command: list[str] | None = None


PEER_FIELDS = ("command", "max_iters")


@dataclass
class ExperimentSpec:
    """A parsed experiment file (see the module docstring)."""

    name: str
    path: Path
    description: str
    conclusion: str
    seeds: list[int]
    metrics: list[str]
    base: dict[str, Any]
    cells: list[Cell]
    compare: list[dict[str, str]] = field(default_factory=list)
    plots: list[dict[str, str]] = field(default_factory=list)
    higher_is_better: list[str] = field(default_factory=list)
    descriptive: list[str] = field(default_factory=list)
    evaluate: bool = False
    confirm: bool = False
    claim: str = ""
    alpha: float = 0.05
    data_sha256: dict[str, str] = field(default_factory=dict)
    data_generator: dict[str, Any] | None = None
    test_sets: tuple[str, ...] = ("test",)  # the held-out sets of its cells' tasks

    @property
    def test_metrics(self) -> list[str]:
        """The test metrics it names (``metrics``, ``[[compare]]``, ``[[plots]]``), in order."""
        named = [*self.metrics, *(c["metric"] for c in self.compare), *(p["metric"] for p in self.plots)]
        return [m for m in dict.fromkeys(named) if is_test_metric(m, self.test_sets)]

    @property
    def legacy(self) -> bool:
        """An exploratory spec that names test metrics: written before the protocol, report only."""
        return not self.confirm and bool(self.test_metrics)

    @property
    def reads_test(self) -> bool:
        """Whether its runs read the test sets (confirmatory; legacy runs did, and keep their files)."""
        return self.confirm or self.legacy

    @property
    def folder(self) -> str:
        """``probes`` for ``experiments/probes/NAME.toml``, else empty: where under results/ it reports."""
        return PROBES if self.path.parent.name == PROBES else ""

    def runs_root(self, runs: Path) -> Path:
        """Where its run directories live: ``runs``, shared by every exploratory experiment whose
        settings agree; a confirmation's apart (``runs/confirmations/NAME``), trained for it alone."""
        return runs / "confirmations" / self.name if self.confirm else runs

    def config(self, cell: Cell, seed: int, runs: Path) -> dict[str, Any]:
        """The TrainConfig fields (as a dict) of ``cell`` at ``seed``, its run directory under ``runs``;
        for a peer cell its filled-in ``command``, ``max_iters`` and run directory."""
        if cell.command is not None:
            key = {"peer": cell.command, "max_iters": cell.fields["max_iters"], "data": self.base.get("data")}
            digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
            out = runs / f"peer-{_slug(cell.name)[:40]}-{digest}" / f"seed_{seed}"
            fill = {
                "seed": seed,
                "out": str(out),
                "data": self.base.get("data") or "",
                "peers": peers_dir(),
                "python": sys.executable,
            }
            try:  # {threads} is the runner's to fill, when it knows how many each run gets
                command = [a.format(**fill, threads="{threads}") for a in cell.command]
            except (KeyError, IndexError, ValueError) as err:
                raise ConfigError(
                    f"command placeholder {err} unknown; use {{seed}} {{out}} {{data}} "
                    "{{threads}} {{peers}}"
                ) from None
            # the task its predictions are measured on (an experiment with `evaluate`), apart from the key
            task = {k: self.base[k] for k in ("task", "data", "task_options", "block_size") if k in self.base}
            return {
                "command": command,
                "max_iters": cell.fields["max_iters"],
                "out": str(out),
                "seed": seed,
                "evaluate_on": task,
                "read_test": self.reads_test,
            }
        values = dict(self.base)
        for key, value in cell.fields.items():
            if key in ("model_options", "task_options"):
                values[key] = {**values.get(key, {}), **value}
            else:
                values[key] = value
        values.update(seed=seed, out=None, read_test=self.reads_test)
        config = build_config(values).to_dict()
        config["out"] = str(cell_dir(runs, config))
        return config


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", text).strip("_") or "cell"


def _peer_cell(raw: dict[str, Any], where: str) -> Cell:
    """A peer cell from its table (``name``, ``command``, ``max_iters``); ConfigError naming the fault."""
    command = raw.get("command")
    extra = sorted(set(raw) - {"name", *PEER_FIELDS})
    if not isinstance(command, list) or not command or not all(isinstance(a, str) for a in command):
        raise ConfigError(f"{where}: cell {raw['name']!r}: command must be a non-empty list of strings")
    if extra or not isinstance(raw.get("max_iters"), int):
        raise ConfigError(
            f"{where}: peer cell {raw['name']!r} takes command and max_iters (an integer) only"
            + (f", got {', '.join(extra)}" if extra else "")
        )
    return Cell(raw["name"], {"max_iters": raw["max_iters"]}, command)


def load_peers(path: Path) -> dict[str, dict[str, Any]]:
    """The named peer cells of ``path`` (``experiments/peers.toml``): id → its table (``name``,
    ``command``, ``max_iters``), each checked as an experiment's peer cell is; ConfigError (one line)."""
    doc = read_toml(path, "peer file")
    for key, table in doc.items():
        if not isinstance(table, dict) or not isinstance(table.get("name"), str):
            raise ConfigError(f"peer file {path}: [{key}] needs a name, a command and max_iters")
        _peer_cell(table, f"peer file {path}")
    return doc


def find_spec(name: str) -> Path:
    """``experiments/NAME.toml`` or ``experiments/probes/NAME.toml`` (relative to the working
    directory), or ``name`` as a path."""
    candidates = [Path(name), EXPERIMENTS_DIR / f"{name}.toml", EXPERIMENTS_DIR / PROBES / f"{name}.toml"]
    for path in candidates:
        if path.is_file():
            if path.name == PEERS_FILE:
                raise ConfigError(f"{path} holds the peer cells experiments name, not an experiment")
            return path
    found = [*EXPERIMENTS_DIR.glob("*.toml"), *(EXPERIMENTS_DIR / PROBES).glob("*.toml")]
    available = sorted(p.stem for p in found if p.name != PEERS_FILE)
    raise ConfigError(
        f"no experiment {name!r}: neither {candidates[1]}, {candidates[2]} nor a file {name} exists"
        + (f"; available: {', '.join(available)}" if available else "")
    )


def peers_file(spec_path: Path) -> Path:
    """The ``peers.toml`` a spec's peer cells name: beside it, or (a probe's) one folder up."""
    beside = spec_path.parent / PEERS_FILE
    if spec_path.parent.name == PROBES and not beside.is_file():
        return spec_path.parent.parent / PEERS_FILE
    return beside


def load_spec(name: str) -> ExperimentSpec:
    """Parse and check an experiment file; ConfigError (one line) naming the problem."""
    path = find_spec(name)
    doc = read_toml(path, "experiment file")
    where = f"experiment file {path}"
    unknown = sorted(set(doc) - TOP_KEYS)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(TOP_KEYS))}"
        )
    seeds = doc.get("seeds", [1337])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise ConfigError(f"{where}: seeds must be a non-empty list of integers, got {seeds!r}")
    metrics = doc.get("metrics")
    if not isinstance(metrics, list) or not metrics or not all(isinstance(m, str) for m in metrics):
        raise ConfigError(f"{where}: metrics must be a non-empty list of metric names")
    base = doc.get("base", {})
    if not isinstance(base, dict):
        raise ConfigError(f"{where}: [base] must be a table of TrainConfig fields")
    raw_cells = doc.get("cells")
    if not isinstance(raw_cells, list) or not raw_cells:
        raise ConfigError(f"{where}: needs at least one [[cells]] entry")
    cells, names = [], set()
    peers: dict[str, dict[str, Any]] | None = None  # read when a cell first names one
    for index, raw in enumerate(raw_cells):
        if isinstance(raw, dict) and "peer" in raw:
            extra = sorted(set(raw) - {"peer"})
            if extra:
                raise ConfigError(
                    f"{where}: cell {index + 1} names peer {raw['peer']!r} and takes nothing else, got "
                    f"{', '.join(extra)} (a peer's name, command and budget live in {PEERS_FILE})"
                )
            if not isinstance(raw["peer"], str):
                raise ConfigError(
                    f"{where}: cell {index + 1}: peer must be an id (a string), got {raw['peer']!r}"
                )
            if peers is None:
                try:
                    peers = load_peers(peers_file(path))
                except ConfigError as err:
                    raise ConfigError(
                        f"{where}: cell {index + 1} names peer {raw['peer']!r}: {err}"
                    ) from None
            if raw["peer"] not in peers:
                raise ConfigError(
                    f"{where}: cell {index + 1}: no peer {raw['peer']!r} in {peers_file(path)}"
                    + (f"; defined: {', '.join(sorted(peers))}" if peers else "")
                )
            raw = peers[raw["peer"]]
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise ConfigError(f"{where}: cell {index + 1} needs a name")
        fields = {k: v for k, v in raw.items() if k != "name"}
        if "command" in fields:
            cell = _peer_cell(raw, where)
            if _slug(cell.name) in names:
                raise ConfigError(f"{where}: two cells named {cell.name!r}")
            names.add(_slug(cell.name))
            cells.append(cell)
            continue
        bad = sorted(k for k in [*fields, *base] if k not in FIELDS or k in ("out", "seed", "read_test"))
        if bad:
            raise ConfigError(
                f"{where}: cell {raw['name']!r}: {', '.join(bad)} are not settable TrainConfig fields"
            )
        if _slug(raw["name"]) in names:
            raise ConfigError(f"{where}: two cells named {raw['name']!r}")
        names.add(_slug(raw["name"]))
        cells.append(Cell(raw["name"], fields))
    cell_names = {c.name for c in cells}
    compare = doc.get("compare", [])
    for entry in compare:
        missing = [k for k in ("a", "b", "metric") if k not in entry]
        if missing or entry["a"] not in cell_names or entry["b"] not in cell_names:
            raise ConfigError(f"{where}: [[compare]] needs a, b (cell names) and metric, got {entry}")
    plots = doc.get("plots", [])
    for entry in plots:
        if entry.get("kind") not in PLOT_KINDS or "metric" not in entry:
            raise ConfigError(f"{where}: [[plots]] needs kind in {PLOT_KINDS} and metric, got {entry}")
    spec = ExperimentSpec(
        name=path.stem,
        path=path,
        description=str(doc.get("description", "")),
        conclusion=str(doc.get("conclusion", "")),
        seeds=seeds,
        metrics=metrics,
        base=base,
        cells=cells,
        compare=compare,
        plots=plots,
        higher_is_better=list(doc.get("higher_is_better", [])),
        descriptive=list(doc.get("descriptive", [])),
        evaluate=bool(doc.get("evaluate", False)),
        confirm=doc.get("confirm", False),
        claim=str(doc.get("claim", "")),
        alpha=doc.get("alpha", 0.05),
        data_sha256=doc.get("data_sha256", {}),
        data_generator=doc.get("data_generator"),
        test_sets=_test_sets(base, cells),
    )
    for cell in cells:  # every cell must build a valid TrainConfig (types, ranges, the task exists)
        try:
            spec.config(cell, seeds[0], Path("runs"))
        except ConfigError as err:
            raise ConfigError(f"{where}: cell {cell.name!r}: {err}") from None
    _check_protocol(spec, where)
    return spec


def _test_sets(base: dict[str, Any], cells: list[Cell]) -> tuple[str, ...]:
    """The held-out sets (``Task.test_sets``) of every task its cells train on, in order."""
    from geoattn.tasks import task_class

    names = [cell.fields.get("task", base.get("task", TrainConfig.task)) for cell in cells]
    sets: dict[str, None] = {}
    for name in dict.fromkeys(names):
        try:
            sets.update(dict.fromkeys(task_class(name).test_sets))
        except ConfigError:  # an unknown task: the cells' own check names it
            continue
    return tuple(sets)


HEX64 = re.compile(r"[0-9a-f]{64}")


def _check_protocol(spec: ExperimentSpec, where: str) -> None:
    """The protocol's fields: types, and what a confirmation must declare; ConfigError (one line)."""
    if not isinstance(spec.confirm, bool):
        raise ConfigError(f"{where}: confirm must be true or false, got {spec.confirm!r}")
    if isinstance(spec.alpha, bool) or not isinstance(spec.alpha, float) or not 0 < spec.alpha < 1:
        raise ConfigError(f"{where}: alpha must be a number in (0, 1), got {spec.alpha!r}")
    if not isinstance(spec.data_sha256, dict) or not all(
        isinstance(v, str) and HEX64.fullmatch(v) for v in spec.data_sha256.values()
    ):
        raise ConfigError(f"{where}: data_sha256 must map file paths to sha256 digests (64 lowercase hex)")
    generator = spec.data_generator
    if generator is not None and (
        not isinstance(generator, dict)
        or not {"name", "version", "seed"} <= set(generator) <= GENERATOR_KEYS
        or not isinstance(generator["seed"], int)
    ):
        raise ConfigError(
            f"{where}: data_generator needs name, version and seed (an integer), and may name option "
            f"(the task.* key holding the seed), got {generator!r}"
        )
    if not spec.confirm:
        if spec.data_sha256 or generator is not None or spec.claim:
            raise ConfigError(f"{where}: claim, data_sha256 and data_generator belong to confirm = true")
        return
    seeds = spec.seeds
    if len(set(seeds)) != len(seeds) or len(seeds) < MIN_CONFIRM_SEEDS:
        raise ConfigError(
            f"{where}: a confirmation needs at least {MIN_CONFIRM_SEEDS} distinct seeds, got {seeds}"
        )
    if not spec.compare:
        raise ConfigError(f"{where}: a confirmation declares its primary comparisons ([[compare]])")
    if not spec.claim.strip():
        raise ConfigError(f'{where}: a confirmation states its claim (claim = "...")')
    if bool(spec.data_sha256) == (generator is not None):
        raise ConfigError(
            f"{where}: a confirmation declares its data: data_sha256 (files) or data_generator, one of them"
        )
    if generator is not None:
        option = generator.get("option", "seed")
        for cell in spec.cells:
            options = spec.config(cell, seeds[0], Path("runs")).get("task_options") or spec.base.get(
                "task_options", {}
            )
            if options.get(option) != generator["seed"]:
                raise ConfigError(
                    f"{where}: cell {cell.name!r} draws its data with task.{option} = "
                    f"{options.get(option)!r}, the data_generator declares seed {generator['seed']}"
                )


# fields that do not change what a run computes: left out of its directory's key (``compile`` runs the
# same maths through torch.compile: a cell's runs may mix compiled and eager ones, and share runs)
# (``read_test``: an exploratory run that sealed its test sets trained the same model as one that did not)
NOT_KEYED = ("out", "seed", "logger", "plots", "log_interval", "compile", "read_test")


def cell_dir(runs: Path, config: dict[str, Any]) -> Path:
    """Where a run lives: ``RUNS/TASK-MODEL-HASH/seed_SEED``, HASH a digest of the TrainConfig fields
    that differ from their defaults (but ``NOT_KEYED``). Experiments that share a setting (the baseline
    of an ablation, the clean cell of a noise sweep) therefore share its runs instead of training them
    twice, and a new TrainConfig field with a default leaves existing runs where they are."""
    defaults = TrainConfig().to_dict()
    keyed = {k: v for k, v in config.items() if k not in NOT_KEYED and v != defaults.get(k, object())}
    digest = hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode()).hexdigest()[:10]
    return runs / f"{config['task']}-{config['model']}-{digest}" / f"seed_{config['seed']}"
