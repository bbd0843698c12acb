"""GATr's own n-body code as a peer of `geoattn bench train --task nbody --peer gatr`: whole runs on the
same files, through the drivers' protocol (``peer_protocol.py``: flags, check, plan, run).

GATr runs from its checkout in its own venv (``benchmarks/README.md`` sets both up) through
``benchmarks/gatr_nbody.py``, which drives GATr's experiment manager with its hydra config: model,
optimiser, schedule, validation (every 1,000 steps) and the closing evaluation of its four sets are
GATr's. Our side is ``geoattn train --task nbody`` with the task's recipe. Both sides read the same
GATr-format directory (``--data`` after ``--``) and keep their own evaluation cadence, as a user of each
would run it.

Our flags that reach GATr (:data:`MAPPED`): ``--max-iters N`` (its ``--steps N``), ``--batch-size``,
``--seed``, ``--data``, and ``--set task.train_size=N`` (its ``--train-size N``; 1,000 on both sides
unless given, GATr's published budget). :data:`OURS_ONLY` change our optimiser or process, not the work
per step. Any other flag (a width, a depth) would change one side's cost only and is refused.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from peer_protocol import Driver, main, timed_process

from geoattn.bench.common import flag_names, flag_value, git_revision, peers_dir
from geoattn.core.errors import ConfigError

ROW = "GATr (its own code)"
LR = 2e-3  # the rate GATr's validation chose in experiments/nbody-lr.toml (its config's is 3e-4)
TRAIN_SIZE = 1000  # GATr's budget: the first 1,000 samples of train.npz
MAPPED = {"--max-iters": "--steps", "--batch-size": "--batch-size", "--seed": "--seed", "--data": "--data"}
OURS_ONLY = ("--compile", "--no-plots", "--lr", "--min-lr", "--lr-schedule", "--warmup-iters")
SETS = ("train", "val", "eval", "e3_generalization", "object_generalization")
RUNNER = Path(__file__).resolve().parent / "gatr_nbody.py"


def check(repo: Path, python: Path) -> None:
    """A one-line ConfigError unless ``repo`` is a GATr checkout and ``python`` an interpreter."""
    if (
        not (repo / "gatr" / "experiments" / "nbody").is_dir()
        or not (repo / "config" / "nbody.yaml").is_file()
    ):
        raise ConfigError(
            f"no GATr checkout at {repo} (gatr/experiments/nbody, config/nbody.yaml): clone "
            "Qualcomm-AI-research/geometric-algebra-transformer there (benchmarks/README.md), "
            "or pass --gatr DIR"
        )
    if not python.is_file():
        raise ConfigError(
            f"no GATr venv interpreter at {python}: see benchmarks/README.md, or pass --gatr-python"
        )


def set_values(argv: list[str]) -> list[str]:
    """The ``KEY=VALUE`` arguments of every ``--set`` in ``argv``."""
    values = []
    for i, arg in enumerate(argv):
        if arg == "--set" and i + 1 < len(argv):
            values.append(argv[i + 1])
        elif arg.startswith("--set="):
            values.append(arg.split("=", 1)[1])
    return values


def runner_args(argv: list[str], threads: int) -> tuple[list[str], list[str]]:
    """``gatr_nbody.py``'s arguments for our ``geoattn train`` arguments ``argv``, and ``argv`` with
    what both sides need added (``task.train_size``). A one-line ConfigError for a flag GATr cannot
    follow or a missing ``--data``."""
    flags = flag_names(argv)
    sets = set_values(argv)
    refused = [f for f in flags if f not in MAPPED and f not in OURS_ONLY and f != "--set"]
    refused += [f"--set {s}" for s in sets if not s.startswith("task.train_size=")]
    if refused:
        raise ConfigError(
            f"--peer gatr runs the same work per step on both sides; {', '.join(refused)} would change ours "
            f"only (flags that reach GATr: {', '.join(MAPPED)}, --set task.train_size=N; ours only: "
            f"{', '.join(OURS_ONLY)})"
        )
    values = {flag: flag_value(argv, flag) for flag in MAPPED}
    if values["--data"] is None:
        raise ConfigError(
            "--peer gatr trains on GATr's files: pass -- --data DIR (benchmarks/README.md makes them)"
        )
    data = Path(values["--data"])
    missing = [name for name in SETS if not (data / f"{name}.npz").is_file()]
    if missing:
        raise ConfigError(f"--data {data} has no {', '.join(f'{m}.npz' for m in missing)} (GATr's five sets)")
    train_size = next((s.split("=", 1)[1] for s in reversed(sets)), None)
    if train_size is None:
        train_size = str(TRAIN_SIZE)
        argv = [*argv, "--set", f"task.train_size={TRAIN_SIZE}"]
    args = ["--lr", repr(LR), "--train-size", train_size, "--threads", str(threads)]
    args += ["--seed", values["--seed"] or "1337"]  # our default seed, so both sides start alike
    for flag in ("--max-iters", "--batch-size"):
        args += [MAPPED[flag], values[flag]] if values[flag] is not None else []
    return [*args, "--data", str(data.resolve())], argv


def command(python: Path, repo: Path, args: list[str], run_dir: Path) -> list[str]:
    """The ``gatr_nbody.py`` process of one run, writing ``run_dir/metrics.json``."""
    return [str(python), str(RUNNER), "--gatr", str(repo), *args, "--out", str(run_dir)]


def parse_metrics(run_dir: Path) -> dict[str, float]:
    """From a run's ``metrics.json``: its trainer ``wall`` (GATr's whole ``train()``, validation
    included), ``step`` (seconds per step without validation) and ``metric`` (MSE on the whole val
    set). ValueError if the file is missing."""
    path = run_dir / "metrics.json"
    if not path.is_file():
        raise ValueError(f"no {path}")
    metrics = json.loads(path.read_text())
    return {"wall": metrics["wall_s"], "step": metrics["s_per_step"], "metric": metrics["val_mse_full"]}


def venv_python(python: Path | None) -> Path:
    """GATr's venv interpreter: ``python`` if given, else ``$GEOATTN_PEERS/gatr-venv/bin/python``."""
    return python or (Path(peers_dir()) / "gatr-venv" / "bin" / "python").resolve()


class GATr(Driver):
    def flags(self) -> dict:
        reach = {**MAPPED, "--set task.train_size=N": "--train-size N"}
        return {
            "row": ROW,
            "task": "nbody",
            "trains": "GATr's n-body experiment",
            "reach": reach,
            "ours_only": list(OURS_ONLY),
        }

    def check(self, repo: Path, python: Path | None) -> None:
        check(repo, venv_python(python))

    def plan(self, repo: Path, python: Path | None, threads: int, out: Path, args: list[str]) -> dict:
        gatr_args, ours = runner_args(args, threads)
        rev = git_revision(repo)
        cmd = " ".join(command(venv_python(python), repo, gatr_args, out / "gatr_R"))
        notes = [
            "final: the MSE on the whole val set, both sides (GATr's at the state its early stopping keeps); "
            "trainer: ours the run's wall_s, GATr's its whole train() (its validation every 1,000 steps "
            "included); step: GATr's without its validation passes.",
            f"GATr: {cmd} (checkout {repo}{' at ' + rev if rev else ''}, lr {LR:g} as chosen in "
            "experiments/nbody-lr.toml)",
        ]
        return {"ours": ours, "notes": notes}

    def run(self, repo: Path, python: Path | None, threads: int, out: Path, args: list[str]) -> dict:
        gatr_args, _ = runner_args(args, threads)
        cmd = command(venv_python(python), repo, gatr_args, out)
        return timed_process("GATr", cmd, Path.cwd(), out, lambda text: parse_metrics(out))


if __name__ == "__main__":
    sys.exit(main(GATr()))
