"""The sealed protocol of `geoattn experiment`: exploratory experiments read validation only, a
confirmation is recorded in the ledger before its first test read and refused when its protocol
changes, its report reads its comparisons as one Holm-adjusted family.

The runs train a toy task (a linear map of generated data, registered for these tests only) that counts
every read of its test set, so a sealed run is seen not to read it."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor, nn

from geoattn.cli import main
from geoattn.core.errors import DataError
from geoattn.experiments import execute, load_spec, plan
from geoattn.experiments import ledger as ledger_module
from geoattn.experiments.report import check_confirmations, holm, welch, welch_interval
from geoattn.models.base import TaskModel
from geoattn.tasks import TASKS
from geoattn.tasks.base import ModelRow, Task
from geoattn.training.config import TrainConfig
from geoattn.training.trainer import Trainer, run_task


@dataclass
class ToySettings:
    seed: int = 0  # the draw of the data


@dataclass
class LinearConfig:
    features: int = 4


class Linear(TaskModel):
    def __init__(self) -> None:
        super().__init__()
        self.config = LinearConfig()
        self.map = nn.Linear(4, 1)

    def forward(self, x: Tensor, y: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        prediction = self.map(x).squeeze(-1)  # (B,)
        return prediction, None if y is None else (prediction - y).pow(2).mean()


class ToyTask(Task):
    """y = x·w + noise on generated sets; ``test_reads`` counts every read of the test set."""

    name = "toy"
    Settings = ToySettings
    table = {"linear": ModelRow(LinearConfig, lambda task, sizes, options: Linear(), "a linear map")}
    test_reads: ClassVar[list[str]] = []

    def __init__(self, settings: ToySettings) -> None:
        g = torch.Generator().manual_seed(settings.seed)
        w = torch.randn(4, generator=g)
        self.sets = {}
        for name, n in (("train", 64), ("val", 32), ("test", 32)):
            x = torch.randn(n, 4, generator=g)
            self.sets[name] = (x, x @ w + 0.1 * torch.randn(n, generator=g))

    @classmethod
    def from_settings(cls, settings, *, data, block_size, meta, load_data) -> ToyTask:
        return cls(settings)

    def _read(self, name: str) -> tuple[Tensor, Tensor]:
        if name in self.test_sets:
            assert self.readable(name), f"{name} is sealed"
            ToyTask.test_reads.append(name)
        return self.sets[name]

    def get_batch(self, split, batch_size, generator, device="cpu"):
        x, y = self._read(split)
        index = torch.randint(len(y), (batch_size,), generator=generator)
        return x[index].to(device), y[index].to(device)

    @torch.no_grad()
    def final_metrics(self, model, device) -> dict[str, float]:
        out = {}
        for name in ("val", "test"):
            if self.readable(name):
                x, y = self._read(name)
                out[f"{name}_mse" if name == "test" else "val_mse_full"] = float(model(x, y)[1])
        return out


@pytest.fixture(autouse=True)
def toy(monkeypatch):
    monkeypatch.setitem(TASKS, "toy", f"{__name__}:ToyTask")
    ToyTask.test_reads.clear()


HEAD = """
description = "toy"
seeds = {seeds}
metrics = {metrics}
{extra}
[base]
task = "toy"
model = "linear"
max_iters = 4
eval_interval = 2
eval_iters = 1
batch_size = 8
warmup_iters = 0
plots = false
task_options = {{ seed = {data_seed} }}

[[cells]]
name = "fast"
lr = 0.05

[[cells]]
name = "slow"
lr = {slow_lr}
"""
COMPARE = '\n[[compare]]\na = "fast"\nb = "slow"\nmetric = "{metric}"\n'
CONFIRM = (
    'confirm = true\nclaim = "A larger step fits the toy map better."\n'
    'data_generator = {{ name = "toy", version = "1", seed = {data_seed} }}\n'
)


def write(
    folder: Path,
    name: str,
    *,
    confirm=True,
    seeds=(1, 2, 3, 4, 5),
    metrics=("test_mse",),
    data_seed=7,
    slow_lr=0.002,
    metric="test_mse",
    extra="",
) -> str:
    text = HEAD.format(
        seeds=list(seeds),
        metrics=json.dumps(list(metrics)),
        extra=(CONFIRM.format(data_seed=data_seed) if confirm else "") + extra,
        data_seed=data_seed,
        slow_lr=slow_lr,
    )
    (folder / "experiments").mkdir(exist_ok=True)
    (folder / "experiments" / f"{name}.toml").write_text(text + COMPARE.format(metric=metric))
    return name


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("geoattn experiment: error:"), err
    return err[0]


def ledger_lines(workdir: Path) -> list[dict[str, Any]]:
    path = workdir / "results" / "ledger.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---------------------------------------------------------------------------------- statistics ----
def test_holm_adjusts_a_family_as_by_hand():
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.02]) == [0.02]
    assert holm([0.5, 0.6]) == pytest.approx([1.0, 1.0])  # capped at 1
    nan_in = holm([0.01, math.nan])  # a comparison without a test still counts in m
    assert nan_in[0] == pytest.approx(0.02) and math.isnan(nan_in[1])


def test_welch_interval_by_hand_and_against_scipy():
    # a = [0, 2], b = [1, 3]: diff −1, SE √2, df 2, t₀.₉₇₅,₂ = 4.302653
    low, high = welch_interval([0.0, 2.0], [1.0, 3.0])
    assert (low, high) == (
        pytest.approx(-1 - 4.302653 * math.sqrt(2)),
        pytest.approx(-1 + 4.302653 * math.sqrt(2)),
    )
    assert all(math.isnan(v) for v in welch_interval([1.0], [1.0, 2.0]))
    stats = pytest.importorskip("scipy.stats")
    a, b = [1.1, 1.4, 0.9, 1.3, 1.2], [1.6, 1.5, 1.9, 1.4, 1.8, 2.0]
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert welch_interval(a, b) == (pytest.approx(ci.low), pytest.approx(ci.high))


# ---------------------------------------------------------------------------------- exploration ----
def test_a_plain_run_reads_the_test_set_and_an_exploratory_one_does_not(workdir):
    config = TrainConfig(
        task="toy", model="linear", max_iters=2, eval_interval=2, eval_iters=1, batch_size=8, plots=False
    )
    summary = Trainer(config, run_task(config), workdir / "plain", verbose=False).train()
    assert "test_mse" in summary["final"] and ToyTask.test_reads
    ToyTask.test_reads.clear()
    sealed = TrainConfig(**{**config.to_dict(), "read_test": False})
    task = run_task(sealed)
    assert task.sealed == frozenset({"test"})
    summary = Trainer(sealed, task, workdir / "sealed", verbose=False).train()
    assert "test_mse" not in summary["final"] and "val_mse_full" in summary["final"]
    assert ToyTask.test_reads == []


def test_an_exploratory_experiment_reads_validation_only(workdir, capsys):
    write(workdir, "explore", confirm=False, seeds=(1,), metrics=("val_mse_full",), metric="val_mse_full")
    assert main(["experiment", "explore"]) == 0
    assert ToyTask.test_reads == []
    report = (workdir / "results" / "explore.md").read_text()
    assert "test_mse" not in report and "val_mse_full" in report
    for run in (workdir / "runs").rglob("summary.json"):
        assert "test_mse" not in json.loads(run.read_text())["final"]
    assert not (workdir / "results" / "ledger.jsonl").exists()  # nothing to record


def test_an_exploratory_spec_naming_a_test_metric_is_legacy_report_only(workdir, capsys):
    write(workdir, "old", confirm=False, seeds=(1,))
    spec = load_spec("old")
    assert spec.legacy and spec.test_metrics == ["test_mse"]
    assert main(["experiment", "old"]) == 2
    assert "names test metrics (test_mse) and is not confirm = true" in one_line_error(capsys)
    assert not (workdir / "runs").exists() and ToyTask.test_reads == []
    assert main(["experiment", "old", "--report-only"]) == 0
    assert "Read before the protocol (legacy)" in (workdir / "results" / "old.md").read_text()


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"seeds": (1, 2, 3, 4)}, "at least 5 distinct seeds"),
        ({"seeds": (1, 1, 2, 3, 4)}, "at least 5 distinct seeds"),
        ({"extra": "alpha = 2.0\n"}, "alpha must be a number in (0, 1)"),
        ({"extra": 'data_sha256 = { "x" = "' + "a" * 64 + '" }\n'}, "data_sha256 (files) or data_generator"),
    ],
)
def test_a_confirmation_that_declares_too_little_is_one_line(workdir, capsys, changes, fragment):
    write(workdir, "bad", **changes)
    assert main(["experiment", "bad", "--dry-run"]) == 2
    assert fragment in one_line_error(capsys)


def test_a_generator_seed_the_cells_do_not_draw_is_refused(workdir, capsys):
    write(workdir, "bad")
    path = workdir / "experiments" / "bad.toml"
    path.write_text(path.read_text().replace("seed = 7 }\n\n[base]", "seed = 8 }\n\n[base]"))
    assert main(["experiment", "bad", "--dry-run"]) == 2
    assert "draws its data with task.seed = 7, the data_generator declares seed 8" in one_line_error(capsys)


# -------------------------------------------------------------------------------- confirmation ----
def test_a_confirmation_is_recorded_reported_and_refused_when_changed(workdir, capsys):
    name = write(workdir, "confirm-toy")
    spec = load_spec(name)
    runs = workdir / "runs" / "experiments"  # the command's default
    plans = plan(spec, runs)
    assert all("confirmations/confirm-toy" in p.out.as_posix() for p in plans)
    # an interrupted first sitting: two runs, then the whole grid with the same spec resumes
    execute(spec, plans[:2], print_line=lambda line: None)
    assert len(ledger_lines(workdir)) == 1 and ToyTask.test_reads
    assert main(["experiment", name]) == 0
    assert "[8/8]" in capsys.readouterr().out  # the two finished runs were kept
    (entry,) = ledger_lines(workdir)
    assert entry["experiment"] == name and entry["seeds"] == [1, 2, 3, 4, 5]
    assert entry["cells"] == ["fast", "slow"] and entry["spec_sha256"] == ledger_module.spec_hash(spec)
    assert entry["data"] == {"generator": {"name": "toy", "version": "1", "seed": 7, "option": "seed"}}
    assert len(entry["commit"] or "x" * 40) == 40 and "time" in entry and "dirty" in entry

    # the report: effects, Welch CI and p, Holm over the family, from the runs' own numbers
    values = {
        c: [
            json.loads((p.out / "summary.json").read_text())["final"]["test_mse"]
            for p in plan(spec, runs)
            if p.cell.name == c
        ]
        for c in ("fast", "slow")
    }
    summary = json.loads((workdir / "results" / f"{name}.json").read_text())
    (row,) = summary["comparisons"]
    diff, _, _, _, p = welch(values["fast"], values["slow"])
    assert row["effect"] == pytest.approx(statistics.fmean(values["fast"]) - statistics.fmean(values["slow"]))
    assert row["relative"] == pytest.approx(diff / statistics.fmean(values["slow"]))
    assert row["p"] == pytest.approx(p) and row["p_holm"] == pytest.approx(p)  # a family of one
    assert row["ci95"] == pytest.approx(list(welch_interval(values["fast"], values["slow"])))
    assert row["confirmed"] == (p < 0.05) and summary["claim"].startswith("A larger step")
    report = (workdir / "results" / f"{name}.md").read_text()
    assert "## Confirmation" in report and "Holm" in report and "line 1" in report
    assert check_confirmations(workdir / "results") == []
    capsys.readouterr()
    assert main(["experiment", "--ledger"]) == 0
    listing = capsys.readouterr().out
    assert "1 confirmations" in listing and name in listing

    # the same spec again: nothing retrained, nothing recorded
    reads = len(ToyTask.test_reads)
    assert main(["experiment", name]) == 0 and len(ToyTask.test_reads) == reads
    assert len(ledger_lines(workdir)) == 1
    capsys.readouterr()

    # added seeds, then a changed recipe: refused, nothing read, the ledger unchanged
    write(workdir, name, seeds=(1, 2, 3, 4, 5, 6))
    assert main(["experiment", name]) == 2
    assert "seeds [1, 2, 3, 4, 5] -> [1, 2, 3, 4, 5, 6]" in one_line_error(capsys)
    write(workdir, name, slow_lr=0.003)
    assert main(["experiment", name]) == 2
    assert "cell 'slow' changed settings" in one_line_error(capsys)
    assert main(["experiment", name, "--report-only"]) == 2
    one_line_error(capsys)
    assert len(ToyTask.test_reads) == reads and len(ledger_lines(workdir)) == 1

    # a new confirmation on the data this one read: refused; on a fresh draw: allowed
    write(workdir, "again", slow_lr=0.003)
    assert main(["experiment", "again"]) == 2
    assert "was read by confirmation 'confirm-toy'" in one_line_error(capsys)
    write(workdir, "again", slow_lr=0.003, data_seed=8)
    assert main(["experiment", "again", "--dry-run"]) == 0
    assert "not yet recorded" in capsys.readouterr().out and len(ledger_lines(workdir)) == 1


def test_declared_files_are_checked_and_not_shared(workdir, capsys):
    data = workdir / "test.npz"
    data.write_bytes(b"held-out samples")
    digest = ledger_module.file_sha256(data)
    extra = f'data_sha256 = {{ "test.npz" = "{digest}" }}\n'
    for name in ("first", "second"):
        write(workdir, name, extra=extra)
        path = workdir / "experiments" / f"{name}.toml"
        path.write_text(
            path.read_text().replace('data_generator = { name = "toy", version = "1", seed = 7 }\n', "")
        )
    ledger = workdir / "results" / "ledger.jsonl"
    ledger_module.record(load_spec("first"), ledger)
    with pytest.raises(
        ledger_module.ProtocolError, match=f"sha256 {digest}.* was read by confirmation 'first'"
    ):
        ledger_module.record(load_spec("second"), ledger)
    data.write_bytes(b"other samples")
    with pytest.raises(DataError, match="data file test.npz has sha256"):
        ledger_module.record(load_spec("first"), ledger)
    assert len(ledger_lines(workdir)) == 1


def test_check_confirmations_names_a_missing_report_or_ledger_entry(workdir):
    results = workdir / "results"
    results.mkdir()
    summary = {"experiment": "x", "claim": "c", "comparisons": [], "ledger": {"spec_sha256": "abc"}}
    (results / "x.json").write_text(json.dumps(summary))
    problems = check_confirmations(results)
    assert len(problems) == 2 and "no report" in problems[0] and "no entry of 'x'" in problems[1]


def test_every_confirmation_of_the_repository_has_its_report_and_ledger_entry():
    assert check_confirmations(Path(__file__).parents[1] / "results") == []


# -------------------------------------------------------------------------------------- probes ----
def test_a_probe_is_found_by_name_and_reported_under_results_probes(workdir):
    write(workdir, "probe", confirm=False, seeds=(1,), metrics=("val_mse_full",), metric="val_mse_full")
    (workdir / "experiments" / "probes").mkdir()
    (workdir / "experiments" / "probe.toml").rename(workdir / "experiments" / "probes" / "probe.toml")
    assert load_spec("probe").folder == "probes"
    assert main(["experiment", "probe"]) == 0
    assert (workdir / "results" / "probes" / "probe.md").exists()
    assert not (workdir / "results" / "probe.md").exists()


PEER = """
[[cells]]
name = "peer"
max_iters = 1
command = ["{{python}}", "-c", {script}, "{{out}}"]
"""
# a peer's runner: validation always, the test set only where GEOATTN_READ_TEST says it may
HONEST = (  # no braces: the runner fills {placeholders} in a command
    "import json, os, sys; m = dict(val_mse_full=1.0); "
    "m.update(test_mse=2.0) if os.environ['GEOATTN_READ_TEST'] == '1' else None; "
    "open(os.path.join(sys.argv[1], 'metrics.json'), 'w').write(json.dumps(m))"
)
PEEKING = (
    "import json, os, sys; "
    "open(os.path.join(sys.argv[1], 'metrics.json'), 'w').write(json.dumps(dict(test_mse=2.0)))"
)


@pytest.mark.parametrize("script, refused", [(HONEST, False), (PEEKING, True)])
def test_a_peer_reads_the_test_set_only_where_the_experiment_may(workdir, capsys, script, refused):
    extra = PEER.format(script=json.dumps(script))
    write(
        workdir,
        "with-peer",
        confirm=False,
        seeds=(1,),
        metrics=("val_mse_full",),
        metric="val_mse_full",
        extra="",
    )
    path = workdir / "experiments" / "with-peer.toml"
    path.write_text(path.read_text() + extra)
    code = main(["experiment", "with-peer"])
    if refused:
        said = capsys.readouterr()
        assert code == 2 and "wrote test metrics (test_mse) in an exploratory run" in said.out + said.err
        return
    assert code == 0
    summaries = [json.loads(p.read_text())["final"] for p in (workdir / "runs").rglob("summary.json")]
    assert any("val_mse_full" in s for s in summaries) and not any("test_mse" in s for s in summaries)
