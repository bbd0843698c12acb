"""Planning and running an experiment's grid, resumably.

A run is *done* when its ``summary.json`` says it reached ``max_iters`` (and, if the experiment
evaluates, its evaluation exists; a peer's only where its command wrote predictions, in a file per task
they are measured on, :func:`evaluation_file`); it
*resumes* when its directory holds a checkpoint; else it is *new*. Interrupting (Ctrl-C) saves every
running run's checkpoint, so a long suite can be carried across several sittings by running the same
command again.

An exploratory experiment's runs seal their task's test sets (``read_test`` false); a confirmatory
one's read them, after :func:`geoattn.experiments.ledger.record` has written its ledger line (or found
it, resuming) and refused a changed protocol.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from geoattn.core.errors import UserError
from geoattn.experiments import ledger
from geoattn.experiments.spec import Cell, ExperimentSpec
from geoattn.training.run_dir import RunDirectory

PEER_PREDICTIONS = "predictions.npz"  # what a peer's command may write: its predicted targets per set


@dataclass
class RunPlan:
    """One run of the grid and what has to happen to it."""

    cell: Cell
    seed: int
    out: Path
    config: dict[str, Any]  # TrainConfig fields
    status: str  # "done" | "evaluate" | "resume" | "new"
    at_iter: int = 0  # the checkpoint's iteration when resuming


def evaluation_file(config: dict[str, Any]) -> str:
    """The file of a run's evaluation rows: ``evaluation.json``; for a peer (whose run directory
    experiments share whatever task settings they measure it on) ``evaluation-<key>.json``, the key a
    digest of the task, files and options its predictions are measured on (``evaluate_on``)."""
    if "command" not in config:
        return RunDirectory.EVALUATION
    key = json.dumps(config["evaluate_on"], sort_keys=True, default=str)  # a TOML date as its text
    return f"evaluation-{hashlib.sha256(key.encode()).hexdigest()[:10]}.json"


def _status(run: RunDirectory, max_iters: int, evaluate: bool, evaluation: str) -> tuple[str, int]:
    summary = run.read_summary()
    if summary.get("iter") == max_iters and not summary.get("interrupted"):
        if not evaluate or _evaluated(run, evaluation):
            return "done", max_iters
        return "evaluate", max_iters  # trained (e.g. by another experiment), not yet evaluated
    if run.has_checkpoint():
        return "resume", int(run.load_trainer_state()["iter"])
    return "new", 0


def _evaluated(run: RunDirectory, name: str) -> bool:
    """Whether the run's evaluation file ``name`` exists and is newer than a peer's predictions (a
    peer's ``--predict-only`` may write them again after it was evaluated)."""
    evaluation, predictions = run.file(name), run.path / PEER_PREDICTIONS
    if not evaluation.exists():
        return False
    return not predictions.exists() or predictions.stat().st_mtime <= evaluation.stat().st_mtime


def plan(spec: ExperimentSpec, runs: Path) -> list[RunPlan]:
    """Every (seed, cell) of ``spec`` with its run directory under ``runs`` (a confirmation's: under
    :meth:`~geoattn.experiments.spec.ExperimentSpec.runs_root`) and its status."""
    plans = []
    root = spec.runs_root(runs)
    for seed in spec.seeds:  # seed-major: an interrupted suite has every cell at n seeds, not some at 3
        for cell in spec.cells:
            config = spec.config(cell, seed, root)
            out = Path(config["out"])
            # a peer is evaluated where its command wrote what it predicted (e.g. GATr's runner)
            evaluate = spec.evaluate and (cell.command is None or (out / PEER_PREDICTIONS).is_file())
            status, at = _status(RunDirectory(out), config["max_iters"], evaluate, evaluation_file(config))
            plans.append(RunPlan(cell, seed, out, config, status, at))
    return plans


def run_one(
    config: dict[str, Any],
    evaluate: bool,
    threads: int | None = None,
    stop_file: str | None = None,
) -> dict[str, Any]:
    """Train (or resume) one run in this process; evaluate it if asked. Returns its summary.

    Whether it starts, resumes or only evaluates is read from its directory once this process holds
    the run's claim (:func:`_claim`); a run claimed by another live process returns
    ``{"skipped": True, "busy": True}``. A queued run whose ``stop_file`` exists returns
    ``{"skipped": True}`` at once (the suite was interrupted while it waited in a worker's queue)."""
    if stop_file is not None and Path(stop_file).exists():
        return {"skipped": True, "interrupted": True, "iter": None}
    if "command" in config:
        return _run_peer(config, threads, evaluate)
    import torch

    from geoattn.training.config import TrainConfig

    if threads:
        torch.set_num_threads(threads)
    train = TrainConfig(**config)
    run = RunDirectory(train.out)
    lock = _claim(Path(train.out))
    if lock is None:  # another `geoattn experiment` (one sharing this run) is training it now
        return {"skipped": True, "busy": True, "iter": None}
    try:
        return _train_and_evaluate(train, run, evaluate, evaluation_file(config))
    finally:
        lock.unlink(missing_ok=True)


def _train_and_evaluate(train, run: RunDirectory, evaluate: bool, evaluation: str) -> dict[str, Any]:
    from geoattn.training.evaluate import evaluation_rows, load_run
    from geoattn.training.trainer import Trainer, run_task, seal

    # now, under the claim (the plan may be old)
    status, _ = _status(run, train.max_iters, evaluate, evaluation)
    if status == "done":
        return run.read_summary()
    stop_requested = False
    if status in ("new", "resume"):
        resume = status == "resume"
        task = run_task(train, meta=run.read_config()["task"] if resume else None)  # data first
        run.prepare(resume=resume)
        trainer = Trainer(train, task, run.path, verbose=False)
        if resume:
            trainer.resume()
        summary = trainer.train()
        if summary["interrupted"]:
            return summary
        stop_requested = summary.get("stop_requested", False)
    if evaluate:
        loaded = load_run(run.path)
        seal(loaded.task, train)  # this experiment's protocol, whoever trained the run
        rows = [dataclasses.asdict(r) for r in evaluation_rows(loaded)]
        run.write_evaluation(rows, evaluation)
    if stop_requested:
        return {**run.read_summary(), "stop_requested": True}
    return run.read_summary()


def _run_peer(config: dict[str, Any], threads: int | None, evaluate: bool = False) -> dict[str, Any]:
    """Run a peer cell's command (its own code, in its own environment) and record what it measured:
    ``{out}/metrics.json`` becomes the run's ``summary.json`` final metrics (``iter`` = its budget).
    With ``evaluate``, a ``{out}/predictions.npz`` the command wrote is measured as this project's runs
    are (:func:`_evaluate_peer`)."""
    run = RunDirectory(config["out"])
    lock = _claim(run.path)
    if lock is None:
        return {"skipped": True, "busy": True, "iter": None}
    try:
        summary = run.read_summary()
        if summary.get("iter") != config["max_iters"]:
            summary = _train_peer(config, threads, run)
        evaluation = evaluation_file(config)
        if evaluate and (run.path / PEER_PREDICTIONS).is_file() and not _evaluated(run, evaluation):
            rows, sets = _evaluate_peer(config, run.path / PEER_PREDICTIONS)
            run.write_evaluation(rows, evaluation, sets)
        return summary
    finally:
        lock.unlink(missing_ok=True)


def _evaluate_peer(config: dict[str, Any], path: Path) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The task's evaluation rows of a peer's ``predictions.npz`` (an array per set), on the files of
    the experiment's ``data`` (:meth:`geoattn.tasks.base.Task.prediction_rows`), and the sets those
    files hold (:func:`sets_read`: what the report checks every run against)."""
    import numpy as np
    import torch

    from geoattn.tasks import get_task
    from geoattn.training.config import TrainConfig

    where = {"task": TrainConfig.task, "block_size": TrainConfig.block_size, **config["evaluate_on"]}
    data = where.get("data") or None
    task = get_task(where["task"], where.get("task_options"), data=data, block_size=where["block_size"])
    if not config.get("read_test", True):
        task.sealed = frozenset(task.test_sets)
    try:  # a truncated or foreign file fails in many ways (BadZipFile, EOFError, TypeError, ...)
        with np.load(path) as npz:
            predictions = {name: torch.from_numpy(npz[name]) for name in npz.files}
    except Exception as err:
        raise UserError(f"cannot read the peer's predictions {path} ({type(err).__name__}: {err})") from None
    try:
        rows = task.prediction_rows(predictions)
    except ValueError as err:
        raise UserError(f"{path}: {err}") from None
    return [dataclasses.asdict(r) for r in rows], sets_read(task.meta())


def sets_read(meta: dict[str, Any]) -> dict[str, str]:
    """``{set: sha256}`` of a task's ``meta()`` where it records its sets' hashes (the n-body task:
    :meth:`~geoattn.tasks.nbody.task.NBodyTask.meta`), else empty."""
    sets = meta.get("sets") or {}
    return {name: s["sha256"] for name, s in sets.items() if isinstance(s, dict) and "sha256" in s}


def _train_peer(config: dict[str, Any], threads: int | None, run: RunDirectory) -> dict[str, Any]:
    """Run the peer's command under the caller's claim; its ``metrics.json`` as the run's summary.
    What an earlier run of it left to be evaluated goes first (it measured another model)."""
    run.path.mkdir(parents=True, exist_ok=True)
    for stale in (run.path / PEER_PREDICTIONS, run.file(run.EVALUATION), *run.path.glob("evaluation-*.json")):
        stale.unlink(missing_ok=True)
    count = str(threads or os.cpu_count() or 1)
    command = [a.replace("{threads}", count) for a in config["command"]]
    # a peer's runner reads the test sets only where the experiment may (GEOATTN_READ_TEST=1)
    read_test = config.get("read_test", True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": count,
        "MKL_NUM_THREADS": count,
        "GEOATTN_READ_TEST": str(int(read_test)),
    }
    with open(run.path / "peer.log", "w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        raise UserError(f"peer command exited with {done.returncode}; see {run.path / 'peer.log'}")
    try:
        metrics = json.loads((run.path / "metrics.json").read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"peer command wrote no readable {run.path / 'metrics.json'} ({err})") from None
    final = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if not read_test:
        from geoattn.tasks import task_class

        sealed = tuple(f"{name}_" for name in task_class(config.get("task", "lm")).test_sets)
        if read := sorted(k for k in final if k.startswith(sealed)):
            raise UserError(
                f"peer command wrote test metrics ({', '.join(read)}) in an exploratory run: {run.path}"
            )
    summary = {"iter": config["max_iters"], "wall_s": final.get("wall_s", 0.0), "final": final}
    (run.path / RunDirectory.SUMMARY).write_text(json.dumps(summary, indent=2))
    return summary


def _claim(out: Path) -> Path | None:
    """Claim the run ``out`` for this process: ``out.running`` beside it, holding our pid, created
    atomically. None when a live process holds it (two experiments sharing a run, started side by
    side); a claim left by a dead process is taken over."""
    lock = out.with_name(out.name + ".running")
    lock.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                text = lock.read_text()
                if not text:
                    return None  # being claimed right now
                os.kill(int(text), 0)
                return None  # alive
            except (ValueError, ProcessLookupError, FileNotFoundError):
                lock.unlink(missing_ok=True)  # stale: its process is gone
                continue
            except PermissionError:
                return None  # alive, another user's
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return lock
    return None


BUSY = "skipped: another process is training this run (rerun the command once it has finished)"


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _line(index: int, total: int, p: RunPlan, text: str) -> str:
    return f"[{index}/{total}] {p.cell.name} seed {p.seed}: {text}"


def _ending(summary: dict[str, Any], metrics: list[str]) -> str:
    """The last progress word on a run: busy elsewhere, interrupted, or done with its metrics."""
    if summary.get("busy"):
        return BUSY
    if summary.get("interrupted"):
        return f"interrupted at iter {summary['iter']} (checkpoint saved)"
    return "done  " + _outcome(summary, metrics)


def _outcome(summary: dict[str, Any], metrics: list[str]) -> str:
    values = {**summary, **summary.get("final", {})}
    shown = [f"{m} {values[m]:.4g}" for m in metrics if isinstance(values.get(m), (int, float))]
    return "  ".join(shown) + f"  (trained in {summary.get('wall_s', 0):.0f} s)"


def execute(
    spec: ExperimentSpec,
    plans: list[RunPlan],
    *,
    jobs: int = 1,
    threads: int | None = None,
    print_line: Callable[[str], None] = print,
    ledger_path: Path = Path("results") / ledger.LEDGER,
) -> None:
    """Run every plan that is not done: in this process (``jobs=1``) or in ``jobs`` worker
    processes, each run with ``threads`` threads (default: torch's own in this process,
    ``cpu_count // jobs`` in workers; fewer when other work shares the machine, since oversubscribed
    threads slow every process on it). One progress line per run.

    A run that fails with a user error (e.g. an inconsistent checkpoint left by a killed process) is
    reported on its line and the others still run; then a UserError lists the failed runs.

    A confirmation with runs to do is recorded in ``ledger_path`` first (or refused there)."""
    todo = [p for p in plans if p.status != "done"]
    total = len(todo)
    failed: list[str] = []
    check_devices(spec, todo)
    if spec.confirm:
        (ledger.record if todo else ledger.recorded)(spec, ledger_path)

    def fail(index: int, p: RunPlan, err: UserError) -> None:
        print_line(_line(index, total, p, f"failed: {err}"))
        failed.append(f"{p.cell.name} seed {p.seed} ({p.out})")

    try:
        _execute(spec, todo, jobs, threads, print_line, fail)
    finally:
        sys.stdout.flush()
    if failed:
        raise UserError(f"{len(failed)} of {total} runs failed: " + "; ".join(failed))


def check_devices(spec: ExperimentSpec, todo: list[RunPlan]) -> None:
    """A UserError before anything starts when a run to do asks for CUDA and torch sees no GPU (the
    experiments that ran on a GPU machine say so in their ``[base]``)."""
    import torch

    wants = [p for p in todo if str(p.config.get("device", "cpu")).startswith("cuda")]
    if wants and not torch.cuda.is_available():
        raise UserError(
            f"{spec.name}: {len(wants)} runs ask for device cuda and torch sees no CUDA device "
            "(finished runs still report: --report-only)"
        )


def _execute(spec, todo: list[RunPlan], jobs: int, threads: int | None, print_line, fail) -> None:
    total = len(todo)
    if not todo:
        return
    if jobs <= 1:
        for index, p in enumerate(todo, 1):
            begin = {"resume": f"resuming at iter {p.at_iter}", "evaluate": "evaluating"}.get(
                p.status, "starting"
            )
            print_line(_line(index, total, p, begin))
            try:
                summary = run_one(p.config, spec.evaluate, threads)
            except UserError as err:
                fail(index, p, err)
                continue
            print_line(_line(index, total, p, _ending(summary, spec.metrics)))
            if summary.get("interrupted") or summary.get("stop_requested"):
                raise KeyboardInterrupt  # (a Ctrl-C during a run's last step stops before the next)
        return
    threads = threads or max(1, (os.cpu_count() or 1) // jobs)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"))
    stop = Path(todo[0].out).parents[1] / f".stop-{os.getpid()}"  # RUNS/.stop-PID
    stop.unlink(missing_ok=True)
    try:
        futures = {}
        for index, p in enumerate(todo, 1):
            job = (p.config, spec.evaluate, threads, str(stop))
            futures[pool.submit(run_one, *job)] = (index, p)
        for future in as_completed(futures):
            index, p = futures[future]
            try:
                summary = future.result()
            except UserError as err:
                fail(index, p, err)
                continue
            if summary.get("skipped") and not summary.get("busy"):
                continue  # stopped while queued: nothing to say
            print_line(_line(index, total, p, _ending(summary, spec.metrics)))
    except KeyboardInterrupt:
        # Ctrl-C reaches the workers too; a SIGTERM to this process only: pass it on, so every
        # running trainer saves its checkpoint and stops, and runs already queued in a worker
        # see the stop file and return without training (no orphaned worker keeps training)
        stop.touch()
        for worker in list(pool._processes.values()):
            worker.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop.unlink(missing_ok=True)
    pool.shutdown(wait=True)
    sys.stdout.flush()
