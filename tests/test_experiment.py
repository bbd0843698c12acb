"""`geoattn experiment`: planning, skipping finished runs, resuming interrupted ones, aggregation, errors."""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

import pytest
import torch
from conftest import SHAKESPEARE

from geoattn.bench.common import cpu_isa, cpu_model
from geoattn.cli import main
from geoattn.core.errors import CheckpointError
from geoattn.experiments import execute, load_spec, plan, runner
from geoattn.experiments.report import EVERY_SEED, VERDICT_RULE, Stat, compare, verdict, welch
from geoattn.training.config import TrainConfig
from geoattn.training.run_dir import RunDirectory
from geoattn.training.trainer import Trainer, run_task

SPEC = """
description = "a tiny grid"
seeds = [1, 2]
metrics = ["val_loss_full", "params"]
evaluate = true

[base]
task = "lm"
data = "{data}"
max_iters = 6
eval_interval = 3
eval_iters = 1
n_layer = 1
n_head = 2
n_embd = 16
block_size = 8
batch_size = 4
plots = false

[[cells]]
name = "transformer"
model = "transformer"

[[cells]]
name = "rt, no noise"
model = "rt"
model_options = {{ process_noise = false }}

[[compare]]
a = "rt, no noise"
b = "transformer"
metric = "val_loss_full"

[[plots]]
kind = "bar"
metric = "val_loss_full"

[[plots]]
kind = "curve"
metric = "val_loss @"
"""


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An experiments/ folder with tiny.toml over a short text (fast full-split evaluation)."""
    text = tmp_path / "small.txt"
    text.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:4000], encoding="utf-8")
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "tiny.toml").write_text(SPEC.format(data=text))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_dry_run_lists_every_run_then_skips_finished_ones(workdir, capsys):
    assert main(["experiment", "tiny", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "4 runs (4 to run)" in out and out.count("| new") == 4
    assert main(["experiment", "tiny"]) == 0
    out = capsys.readouterr().out
    assert out.count(": done") == 4 and "[4/4]" in out
    report = (workdir / "results" / "tiny.md").read_text()
    assert "rt, no noise − transformer on val_loss_full" in report and "(n=2)" in report
    assert f"({cpu_model()}, {cpu_isa()})" in report  # the CPU behind the report's walls
    assert (workdir / "results" / "tiny_val_loss_full.png").read_bytes()[:4] == b"\x89PNG"
    assert (workdir / "results" / "tiny_val_loss.png").exists()  # the context-length curve
    before = {p: p.stat().st_mtime_ns for p in (workdir / "runs").rglob("model.safetensors")}
    assert main(["experiment", "tiny"]) == 0  # all done: nothing retrained
    assert "[1/" not in capsys.readouterr().out
    assert before == {p: p.stat().st_mtime_ns for p in (workdir / "runs").rglob("model.safetensors")}


def test_an_interrupted_run_resumes_from_its_checkpoint(workdir, monkeypatch):
    spec = load_spec("tiny")
    first = plan(spec, workdir / "runs")[0]  # seed 1, first cell
    config = TrainConfig(**first.config)
    trainer = Trainer(config, run_task(config), first.out, verbose=False)
    step = trainer._step

    def stop_after_three():  # what Ctrl-C does: the trainer saves and stops
        record = step()
        trainer.stop_requested = trainer.iter >= 3
        return record

    monkeypatch.setattr(trainer, "_step", stop_after_three)
    assert trainer.train()["interrupted"]
    plans = plan(spec, workdir / "runs")
    assert (plans[0].status, plans[0].at_iter) == ("resume", 3)
    lines = []
    execute(spec, plans[:1], print_line=lines.append)
    assert "resuming at iter 3" in lines[0] and "done" in lines[1]
    run = RunDirectory(first.out)
    assert [r["iter"] for r in run.metrics()] == [1, 2, 3, 4, 5, 6]
    assert run.read_summary()["iter"] == 6 and run.read_evaluation()
    assert plan(spec, workdir / "runs")[0].status == "done"


def test_a_run_claimed_by_a_live_process_is_left_to_it(workdir):
    """Two experiments sharing a run, started side by side: the second skips it instead of training
    into the same directory; a claim whose process has died is taken over."""
    import subprocess
    import sys

    spec = load_spec("tiny")
    first = plan(spec, workdir / "runs")[:1]
    claim = first[0].out.with_name(first[0].out.name + ".running")
    claim.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        claim.write_text(str(holder.pid))
        lines = []
        execute(spec, first, print_line=lines.append)
        assert "another process is training this run" in lines[-1]
        assert not first[0].out.exists() and claim.exists()
    finally:
        holder.kill()
        holder.wait()
    lines = []
    execute(spec, first, print_line=lines.append)  # its holder is gone: the claim is stale
    assert "done" in lines[-1] and not claim.exists()
    assert plan(spec, workdir / "runs")[0].status == "done"


def test_a_failing_run_is_reported_and_the_others_still_run(workdir, monkeypatch, capsys):
    """A run that raises a user error (here: a damaged checkpoint) fails alone: the rest of the grid
    trains, the report is written, and the command ends with one line naming the failed run, exit 2."""
    import geoattn.experiments.runner as runner

    real = runner._train_and_evaluate
    broken = plan(load_spec("tiny"), workdir / "runs" / "experiments")[1].out

    def train_or_fail(train, run, *args):
        if Path(run.path).resolve() == Path(broken).resolve():
            raise CheckpointError(f"checkpoint in {broken} is inconsistent")
        return real(train, run, *args)

    monkeypatch.setattr(runner, "_train_and_evaluate", train_or_fail)
    assert main(["experiment", "tiny"]) == 2
    captured = capsys.readouterr()
    assert captured.out.count(": done") == 3 and captured.out.count("failed: checkpoint") == 1
    assert "1 of 4 runs failed" in captured.err and len(captured.err.strip().splitlines()) == 1
    assert (workdir / "results" / "tiny.md").exists()


def test_aggregation_and_verdicts_on_known_numbers():
    a, flat = Stat([1.0, 2.0, 3.0]), Stat([2.0, 2.0, 2.0, 2.0])
    assert (a.mean, a.std, a.n) == (2.0, 1.0, 3) and str(a) == "2.000 ± 1.0 (n=3)"
    assert (flat.mean, flat.std) == (2.0, 0.0)
    table = {"a": {"loss": Stat([1.0, 1.2]), "acc": Stat([0.9, 0.91])}, "b": {"loss": Stat([2.0, 2.2])}}
    c = compare(table, "a", "b", "loss")
    assert c.diff == pytest.approx(-1.0) and c.se == pytest.approx(math.sqrt(0.02 / 2 + 0.02 / 2))
    assert "a is better (p < 0.05)" in verdict(c)
    assert "a is worse" in verdict(c, higher_is_better=True)
    assert "a is lower (p < 0.05)" in verdict(c, descriptive=True)
    close = compare({"a": {"m": Stat([1.0, 1.2])}, "b": {"m": Stat([1.1, 1.3])}}, "a", "b", "m")
    assert "no measurable difference (p ≥ 0.05)" in verdict(close)


# (a, b, t, Welch–Satterthwaite df, two-sided p) from scipy.stats.ttest_ind(a, b, equal_var=False)
WELCH_CASES = [
    # the first example of Wikipedia's "Welch's t-test" page (it reads t = −2.46, df = 25.0, p = 0.021)
    (
        [27.5, 21.0, 19.0, 23.6, 17.0, 17.9, 16.9, 20.1, 21.9, 22.6, 23.1, 19.6, 19.0, 21.7, 21.4],
        [27.1, 22.0, 20.8, 23.4, 23.4, 23.5, 25.8, 22.0, 24.8, 20.2, 21.9, 22.1, 22.9, 20.5, 24.4],
        -2.455356,
        24.988529,
        0.021378,
    ),
    # three seeds a side (results/lm.md, rt − ngpt on val_loss_full): 2.8 SE, yet not p < 0.05
    ([1.668, 1.664, 1.672], [1.681, 1.690, 1.675], -2.838097, 3.040799, 0.064717),
    # zero spread on one side: df = n − 1 of the other
    ([1.0, 1.0, 1.0], [1.2, 1.4, 1.3], -5.1962, 2.0, 0.035098),
]


@pytest.mark.parametrize("a, b, t, df, p", WELCH_CASES)
def test_welch_t_test_on_known_numbers(a, b, t, df, p):
    diff, se, t_, df_, p_ = welch(a, b)
    assert diff == pytest.approx(statistics.fmean(a) - statistics.fmean(b))
    assert (t_, df_, p_) == (
        pytest.approx(t, abs=1e-4),
        pytest.approx(df, abs=1e-4),
        pytest.approx(p, rel=1e-4),
    )
    line = verdict(compare({"a": {"m": Stat(a)}, "b": {"m": Stat(b)}}, "a", "b", "m"))
    assert f"t = {t:+.2f}, df = {df:.1f}, p = " in line
    assert ("a is better (p < 0.05)" in line) == (p < 0.05)


def test_welch_t_test_agrees_with_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(0)
    for _ in range(20):
        a = [rng.gauss(0, rng.uniform(0.1, 2)) for _ in range(rng.randint(2, 6))]
        b = [rng.gauss(0.5, rng.uniform(0.1, 2)) for _ in range(rng.randint(2, 6))]
        ref = stats.ttest_ind(a, b, equal_var=False)
        _, _, t, df, p = welch(a, b)
        assert (t, df, p) == (pytest.approx(ref.statistic), pytest.approx(ref.df), pytest.approx(ref.pvalue))


def test_no_verdict_without_a_test():
    one = compare({"a": {"m": Stat([1.0])}, "b": {"m": Stat([1.1, 1.3])}}, "a", "b", "m")
    assert math.isnan(one.p) and "too few seeds for a test (one seed on a side): no verdict." in verdict(one)
    missing = compare({"a": {}, "b": {"m": Stat([1.1, 1.3])}}, "a", "b", "m")
    assert "(n = 0, 2): too few seeds" in verdict(missing)
    constant = compare({"a": {"m": Stat([2.0, 2.0])}, "b": {"m": Stat([1.0, 1.0, 1.0])}}, "a", "b", "m")
    assert constant.se == 0 and math.isnan(constant.t) and math.isnan(constant.p)
    assert verdict(constant).endswith("no spread on either side, so no test: no verdict.")
    same = compare({"a": {"m": Stat([2.0, 2.0])}, "b": {"m": Stat([2.0, 2.0])}}, "a", "b", "m")
    assert verdict(same).endswith("no spread on either side, so no test: identical values.")


def test_verdicts_are_recomputed_from_a_reports_every_seed_table(workdir, capsys):
    results = workdir / "results"
    results.mkdir()
    table = "\n".join(
        [
            "| cell         | seed | val_loss_full | params |",
            "| ------------ | ---- | ------------- | ------ |",
            "| transformer  | 1    | 1.666         | 100    |",
            "| rt, no noise | 1    | 1.668         | 101    |",
            "| transformer  | 2    | 1.679         | 100    |",
            "| rt, no noise | 2    | 1.664         | 101    |",
            "| transformer  | 3    | 1.677         | 100    |",
            "| rt, no noise | 3    | –             | 101    |",
        ]
    )
    old = [
        "# Experiment `tiny`",
        "",
        "a tiny grid",
        "",
        "## Verdicts",
        "",
        "old rule",
        "",
        "* old verdict",
        "",
    ]
    old += ["## Reading", "", "old reading", "", "![val_loss_full](tiny_val_loss_full.png)", ""]
    (results / "tiny.md").write_text("\n".join([*old, EVERY_SEED, "", table, "", "</details>", ""]))
    assert main(["experiment", "tiny", "--from-results"]) == 0
    text = (results / "tiny.md").read_text()
    assert "old" not in text and VERDICT_RULE in text and "wrote results/tiny.md" in capsys.readouterr().out
    a, b = [1.668, 1.664], [1.666, 1.679, 1.677]
    _, _, t, df, p = welch(a, b)
    assert (
        f"* rt, no noise − transformer on val_loss_full: {statistics.fmean(a) - statistics.fmean(b):+.4g}"
        in text
    )
    assert f"t = {t:+.2f}, df = {df:.1f}, p = {p:.2g}): no measurable difference" in text
    assert text.index("## Verdicts") < text.index("![val_loss_full]") < text.index(EVERY_SEED)
    assert table in text and not (workdir / "runs").exists()


def test_from_results_without_a_report_is_one_line(workdir, capsys):
    assert main(["experiment", "tiny", "--from-results"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no 'Every seed' table" in err[0]


def test_cuda_runs_without_a_gpu_are_one_line_before_anything_is_written(workdir, monkeypatch, capsys):
    spec = workdir / "experiments" / "tiny.toml"
    spec.write_text(spec.read_text().replace("plots = false", 'plots = false\ndevice = "cuda"'))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["experiment", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "4 runs ask for device cuda and torch sees no CUDA device" in err[0], err
    assert not (workdir / "results").exists() and not (workdir / "runs").exists()


@pytest.mark.parametrize(
    "content, fragment",
    [
        (None, "no experiment 'tiny'"),
        ("seeds = [1\n", "is not valid TOML"),
        ('metrics = ["x"]\n[[cells]]\nname = "a"\nlearning_rate = 1\n', "learning_rate are not settable"),
        ('metrics = ["x"]\n', "needs at least one [[cells]]"),
        ('metrics = ["x"]\nbogus = 1\n[[cells]]\nname = "a"\n', "unknown key(s) bogus"),
        ('metrics = ["x"]\n[[cells]]\nname = "a"\nlr = -1.0\n', "lr must be > 0"),
    ],
)
def test_a_missing_or_malformed_experiment_is_one_line(tmp_path, monkeypatch, capsys, content, fragment):
    monkeypatch.chdir(tmp_path)
    if content is not None:
        (tmp_path / "experiments").mkdir()
        (tmp_path / "experiments" / "tiny.toml").write_text(content)
    assert main(["experiment", "tiny", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("geoattn experiment: error:") and fragment in err[0], err


def test_summary_has_what_the_report_reads(workdir):
    spec = load_spec("tiny")
    execute(spec, plan(spec, workdir / "runs")[:1], print_line=lambda line: None)
    summary = json.loads((plan(spec, workdir / "runs")[0].out / "summary.json").read_text())
    assert {"iter", "wall_s", "params", "final"} <= set(summary) and "val_loss_full" in summary["final"]


def test_ctrl_c_during_a_runs_last_step_stops_before_the_next_run(workdir, monkeypatch):
    """A Ctrl-C that arrives during the final iteration (its evaluation and save) is too late to stop
    that run, which finishes and is kept; the suite must still stop instead of starting the next."""
    real = Trainer.evaluate

    def evaluate_then_ctrl_c(self):
        result = real(self)
        if self.iter == self.config.max_iters:
            self._request_stop(None, None)
        return result

    monkeypatch.setattr(Trainer, "evaluate", evaluate_then_ctrl_c)
    spec = load_spec("tiny")
    lines = []
    with pytest.raises(KeyboardInterrupt):
        execute(spec, plan(spec, workdir / "runs"), print_line=lines.append)
    assert len(lines) == 2 and "done" in lines[1]  # the first run finished; the second never started
    assert [p.status for p in plan(spec, workdir / "runs")] == ["done", "new", "new", "new"]


def _settings(spec, cell) -> dict[str, object]:
    """A cell's settings, flattened: every TrainConfig field (but its run directory and seed), and
    every field of the model's config after its defaults (``model.KEY``) and of ``task_options``
    (``task.KEY``), so that a value written out at its default counts as no change."""
    from dataclasses import asdict

    from geoattn.models.lm import lm_config

    config = spec.config(cell, spec.seeds[0], Path("runs"))
    flat = {k: v for k, v in config.items() if k not in ("out", "seed", "model_options", "task_options")}
    model = asdict(lm_config(config["model"], **config["model_options"]))
    flat.update({f"model.{k}": v for k, v in model.items()})
    flat.update({f"task.{k}": v for k, v in config["task_options"].items()})
    return flat


def test_rt_predictions_changes_one_setting_at_a_time():
    """Issue 28.3: every verdict of rt-predictions compares a cell with its arm's base cell, and the
    two differ in exactly one setting; each arm covers the RT paper's ingredients."""
    spec = load_spec(str(Path(__file__).parents[1] / "experiments" / "rt-predictions.toml"))
    cells = {c.name: c for c in spec.cells}
    changed: dict[str, set[str]] = {}
    for entry in spec.compare:
        a, b = _settings(spec, cells[entry["a"]]), _settings(spec, cells[entry["b"]])
        differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        assert len(differ) == 1, (entry["a"], entry["b"], differ)
        changed.setdefault(entry["b"], set()).add(differ[0])
    ingredients = {"model.magnitude_precision", "model.qkv_norm", "model.tangent_correction"}
    assert changed == {"transformer": ingredients, "rt": ingredients | {"model.process_noise"}}
    assert {c for e in spec.compare for c in (e["a"], e["b"])} == set(cells)  # no cell without a verdict


def test_threads_per_run_are_the_users_choice(workdir, monkeypatch, capsys):
    """`--threads N` reaches every run (other work on the machine: fewer threads than cores / jobs);
    a bad value is one line and exit code 2."""
    assert main(["experiment", "tiny", "--threads", "0"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--threads" in err
    seen, real = [], runner.run_one

    def spy(config, evaluate, threads=None, stop_file=None):
        seen.append(threads)
        return real(config, evaluate, threads, stop_file)

    monkeypatch.setattr(runner, "run_one", spy)
    before = torch.get_num_threads()
    try:
        assert main(["experiment", "tiny", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 1, 1, 1]


def test_the_report_says_which_data_its_runs_read_and_warns_when_they_differ(tmp_path):
    """Runs that record their sets' hashes (config.json; a peer's evaluation file) are named by them in
    the report: one line when all read the same sets, a warning naming each group when they do not;
    nothing from runs that record none."""
    from geoattn.experiments.report import data_read
    from geoattn.experiments.runner import RunPlan, evaluation_file
    from geoattn.experiments.spec import Cell

    def ours(name: str, seed: int, sets: dict[str, str] | None) -> RunPlan:
        out = tmp_path / f"{name}-{seed}"
        run = RunDirectory(out)
        task = (
            {"task": "nbody", "sets": {k: {"samples": 3, "sha256": v} for k, v in sets.items()}}
            if sets
            else {}
        )
        run.write_config({"train": {}, "task": task})
        return RunPlan(Cell(name, {}), seed, out, {"max_iters": 1}, "done")

    def peer(seed: int, sets: dict[str, str]) -> RunPlan:
        out = tmp_path / f"peer-{seed}"
        config = {"max_iters": 1, "command": ["x"], "evaluate_on": {"task": "nbody", "data": "d"}}
        RunDirectory(out).write_evaluation([], evaluation_file(config), sets)
        return RunPlan(Cell("peer", {}, ["x"]), seed, out, config, "done")

    same = {"train": "a" * 64, "val": "b" * 64}
    plans = [ours("model", 1, same), ours("model", 2, same), peer(1, same), ours("lm", 1, None)]
    (line,) = data_read(plans)
    assert (
        line.startswith("Data: the 3 runs that record it read the same sets") and f"train {'a' * 12}" in line
    )
    other = {"train": "c" * 64, "val": "b" * 64}
    (line,) = data_read([*plans, ours("model", 3, other)])
    assert line.startswith("**Data: the runs did not all read the same sets**")
    assert f"train {'c' * 12}, val {'b' * 12}: model (seed 3)" in line and "peer (seed 1)" in line
    assert data_read([ours("lm", 2, None)]) == []
