"""`geoattn bench train`: whole training runs, as a user starts them, against ``transformer``.

Each run is ``geoattn train --task TASK --model MODEL`` in its own process (the task's recipe unless
arguments after ``--`` change it), the models taken in turn ``--repeats`` times, so that a machine
that drifts slows every model alike. The table gives, per model, the whole process's wall (from its
start to its exit: start-up, data, compile, evaluation, plots, as a user waits) and the trainer's wall
(from the run's ``summary.json``: training and evaluation, without start-up and the final plots), each
as min / median / max with its ratio to ``transformer``'s median, the first step (which compiles), the
median step and the final metric of each run.

``--cache`` sets what compilation costs: ``warm`` (default) gives each model one compile cache
(``TORCHINDUCTOR_CACHE_DIR``), filled by an untimed 3-step run first, as every run after a user's
first one finds it; ``cold`` gives every run an empty one, as a new user's first run, and then runs
it again on the cache it filled (the ``rerun`` column: the user's second run), so that the first and
the warm walls stand side by side.

``--peer nanogpt`` (task lm) also runs nanoGPT's own ``train.py`` from its checkout (``--nanogpt``,
default ``$GEOATTN_PEERS/nanogpt`` or ``../peers/nanogpt``) on its CPU recipe, which is ours: 4 layers
× 4 heads × 128, ctx 64, batch 12, 2,000 steps, on the same corpus (``--data`` after ``--``, else
``$GEOATTN_CORPUS`` or ``../shared/data/tinyshakespeare.txt``), in turn with our models and timed the
same way, its row in the same table. Its data comes from its own ``prepare.py``, run once, untimed, in
``--out``. Which of our flags reach it, and which are refused: ``python benchmarks/peer_nanogpt.py flags``.
E.g.::

    git clone https://github.com/karpathy/nanoGPT ../peers/nanogpt
    geoattn bench train --peer nanogpt --models transformer --repeats 3

``--peer gatr`` (task nbody) runs GATr's own n-body experiment the same way, on the GATr-format files
both sides read (``--data`` after ``--``), with the threads our runs take, at the rate GATr's validation
chose; its row gives its trainer wall too (``benchmarks/peer_gatr.py``)::

    geoattn bench train --task nbody --peer gatr --models rotor --repeats 2 -- --data data/nbody-gatr

A peer's driver is a script of the repository, ``benchmarks/peer_NAME.py``, not a module of the package:
this command reaches it only through its subcommands (``flags``, ``check``, ``plan``, ``prepare``,
``run``; ``benchmarks/peer_protocol.py``), found in ``--peers-scripts`` (default: the ``benchmarks/``
folder beside the package's source tree, so ``--peer`` needs a source checkout of geoattn).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from geoattn.bench.common import flag_value, peers_dir
from geoattn.core.errors import ConfigError, UserError
from geoattn.core.formatting import format_table

CACHES = ("warm", "cold")
PEERS = ("nanogpt", "gatr")
# the flags naming a peer's checkout and its venv's interpreter (a peer without a venv runs ours)
CHECKOUT_FLAG = {"nanogpt": "nanogpt", "gatr": "gatr"}
PYTHON_FLAG = {"gatr": "gatr_python"}
SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks"  # beside the package, in a source checkout
USAGE = (
    "--peer nanogpt also times nanoGPT's own train.py on the same recipe and corpus, each whole process "
    "as a user waits for it: git clone https://github.com/karpathy/nanoGPT ../peers/nanogpt, then "
    "geoattn bench train --peer nanogpt --models transformer --repeats 3 (add -- --max-iters N for "
    "shorter runs on both sides). --peer gatr does the same for GATr's own n-body code on GATr's files "
    "(benchmarks/README.md sets up ../peers/gatr and ../peers/gatr-venv): geoattn bench train --task "
    "nbody --peer gatr --models rotor --repeats 2 -- --data data/nbody-gatr."
)


@dataclass
class Peer:
    """A peer's runs beside ours: its table row, how one run goes (``run(run_dir)`` → ``process``, its
    whole process's wall, and what it reports: ``step``, ``metric``, ``wall`` when it has a trainer wall,
    ``metric_step`` when its metric is from an earlier step), the table's notes for ``--out``, and a
    set-up step in ``--out`` before the first run."""

    row: str
    run: Callable[[Path], dict[str, float]]
    notes: Callable[[Path], list[str]]
    prepare: Callable[[Path], object] | None = None


@dataclass
class PeerScript:
    """A peer's driver, ``benchmarks/peer_NAME.py``, called through its subcommands with our
    interpreter; a subcommand that fails gives its one line as a UserError."""

    path: Path
    checkout: Path
    python: Path | None

    def call(self, command: str, *options: str, args: list[str] = (), json_out: bool = False):
        """Run the driver's ``command`` (``flags``, ``check``, ``plan``, ``prepare``, ``run``) with the
        checkout (and the peer's interpreter where it needs one), ``options``, and ``args`` after
        ``--``; its parsed JSON with ``json_out``, else None. A failure is its last line, a UserError."""
        where = ["--checkout", str(self.checkout)] if command != "flags" else []
        if self.python is not None and command in ("check", "plan", "run"):
            where += ["--python", str(self.python)]
        cmd = [sys.executable, str(self.path), command, *where, *options]
        cmd += ["--", *args] if command in ("plan", "prepare", "run") else []
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            line = (done.stderr.strip().splitlines() or [f"{self.path.name} {command} failed"])[-1]
            raise UserError(line.removeprefix("error: "))
        return json.loads(done.stdout) if json_out else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's flags; arguments after ``--`` go to every `geoattn train` run."""
    parser.epilog = USAGE
    parser.add_argument("--task", default="lm", help="the task whose recipe every run trains")
    parser.add_argument("--models", nargs="+", default=["transformer", "rt"], help="models, in turn")
    parser.add_argument("--repeats", type=int, default=2, help="runs per model")
    parser.add_argument("--cache", choices=CACHES, default="warm", help="compile cache of each run")
    parser.add_argument("--out", help="folder for the runs and caches (default: a new temporary one)")
    parser.add_argument(
        "--peer",
        choices=PEERS,
        help="also run a peer's own code on the same recipe and data, in turn with ours, through its "
        "driver benchmarks/peer_NAME.py: nanoGPT's train.py (task lm; --data after --, else "
        "$GEOATTN_CORPUS or ../shared/data/tinyshakespeare.txt) or GATr's n-body experiment (task nbody; "
        "-- --data DIR of GATr's files); which of our flags after -- reach it: "
        "python benchmarks/peer_NAME.py flags; others are refused",
    )
    parser.add_argument(
        "--peers-scripts",
        help="the folder of the peers' drivers (default: benchmarks/ of the source checkout of geoattn)",
    )
    parser.add_argument(
        "--nanogpt", help="nanoGPT's checkout (default: $GEOATTN_PEERS/nanogpt, else ../peers/nanogpt)"
    )
    parser.add_argument("--gatr", help="GATr's checkout (default: $GEOATTN_PEERS/gatr, else ../peers/gatr)")
    parser.add_argument(
        "--gatr-python",
        help="the interpreter of GATr's venv (default: $GEOATTN_PEERS/gatr-venv/bin/python, "
        "else ../peers/gatr-venv/bin/python)",
    )
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: `geoattn train` arguments")


def run(args: argparse.Namespace) -> int:
    """Train each model ``--repeats`` times in turn and print the table; 2 (one line) on bad input or
    a failed run, whose log it names."""
    extra = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if args.repeats < 1:
        print(f"error: --repeats must be at least 1, got {args.repeats}", file=sys.stderr)
        return 2
    peer = None
    if args.peer is not None:
        peer, extra = _peer(args, extra)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="geoattn-bench-train-"))
    if out.exists() and any(out.iterdir()):
        print(f"error: --out {out} is not empty (nothing there is overwritten)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    if peer is not None and peer.prepare is not None:
        peer.prepare(out)
    base = ["train", "--task", args.task, *extra]
    # untimed: compiles the same graphs into each model's cache (a 3-step run compiles only if told)
    compile_flag = flag_value(extra, "--compile")
    if args.cache == "warm" and compile_flag != "false":
        for model in args.models:
            prime = [*base, "--model", model, "--max-iters", "3", "--out", str(out / f"prime_{model}")]
            prime += ["--compile", "true"] if compile_flag is None else []
            if _train(prime, out / "cache" / model)[0] != 0:
                return _failed(model, out / f"prime_{model}.log")
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in args.models}
    if peer is not None:
        runs[peer.row] = []
    for r in range(args.repeats):
        for model in args.models:
            name = f"{model}_{r}"
            cache = out / "cache" / (model if args.cache == "warm" else name)
            code, process = _train([*base, "--model", model, "--out", str(out / name)], cache)
            if code != 0:
                return _failed(model, out / f"{name}.log")
            record = {"process": process, **_measure(out / name)}
            if args.cache == "cold":  # the same run again on the cache it filled: the user's second run
                code, record["rerun"] = _train(
                    [*base, "--model", model, "--out", str(out / f"{name}_rerun")], cache
                )
                if code != 0:
                    return _failed(model, out / f"{name}_rerun.log")
            runs[model].append(record)
        if peer is not None:
            runs[peer.row].append(peer.run(out / f"{args.peer}_{r}"))
    print(_table(runs, args, extra, out, peer))
    return 0


def _peers_path(given: str | None, name: str) -> Path:
    return Path(given or Path(peers_dir()) / name).resolve()  # the runs start elsewhere


def _peer(args: argparse.Namespace, extra: list[str]) -> tuple[Peer, list[str]]:
    """``--peer NAME``: its driver, checkout and plan, and ``extra`` with what both sides need added; a
    one-line UserError outside a source checkout, for another task, a missing checkout, venv or data,
    or a flag the peer cannot follow."""
    folder = Path(args.peers_scripts) if args.peers_scripts else SCRIPTS
    path = folder / f"peer_{args.peer}.py"
    if not path.is_file():
        raise ConfigError(
            f"--peer {args.peer} runs {path}, which is missing: run from a source checkout of geoattn, "
            "or pass --peers-scripts DIR"
        )
    checkout = _peers_path(getattr(args, CHECKOUT_FLAG[args.peer]), args.peer)
    python = getattr(args, PYTHON_FLAG[args.peer]) if args.peer in PYTHON_FLAG else None
    script = PeerScript(path, checkout, Path(python) if python else None)
    flags = script.call("flags", json_out=True)
    if args.task != flags["task"]:
        raise ConfigError(f"--peer {args.peer} trains {flags['trains']}, not --task {args.task}")
    script.call("check")
    # the same threads as our runs, which take torch's default (the cores)
    threads = ["--threads", str(torch.get_num_threads())]
    plan: dict[str, list[str]] = {}

    def notes(out: Path) -> list[str]:
        return plan["notes"]

    def prepare(out: Path) -> None:
        plan.update(script.call("plan", *threads, "--out", str(out), args=extra, json_out=True))
        script.call("prepare", "--out", str(out), args=plan["ours"])

    def run_one(run_dir: Path) -> dict[str, float]:
        script.call("run", *threads, "--out", str(run_dir), args=plan["ours"])
        return json.loads(Path(f"{run_dir}.json").read_text())

    # planned once before --out exists (its refusals write nothing), again in --out for the notes
    ours = script.call("plan", *threads, "--out", ".", args=extra, json_out=True)["ours"]
    return Peer(flags["row"], run_one, notes, prepare), ours


def _train(argv: list[str], cache: Path) -> tuple[int, float]:
    """One `geoattn train` process with its own compile cache; its output goes to ``<out>.log``.
    Returns its exit status and its wall in seconds, from its start to its exit."""
    run_dir = Path(argv[argv.index("--out") + 1])
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    with open(f"{run_dir}.log", "w") as log:
        cmd = [sys.executable, "-m", "geoattn", *argv]
        start = time.perf_counter()
        code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        return code, time.perf_counter() - start


def _failed(model: str, log: Path) -> int:
    tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
    print(f"error: the {model} run failed: {tail[0] if tail else 'no output'} (log: {log})", file=sys.stderr)
    return 2


def _measure(run_dir: Path) -> dict[str, float]:
    """``wall``, ``first`` and ``step`` (median) in seconds, and the run's final metric."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step_s"] for r in records if "step_s" in r]
    final = summary.get("final") or {}
    metric = next(iter(final.values()), summary.get("val_loss"))
    return {"wall": summary["wall_s"], "first": steps[0], "step": statistics.median(steps), "metric": metric}


def _table(
    runs: dict[str, list[dict]], args: argparse.Namespace, extra: list[str], out: Path, peer: Peer | None
) -> str:
    ref = "transformer" if "transformer" in runs else next(iter(runs))
    peer_row = peer.row if peer is not None else None
    rows = []
    for model, measured in runs.items():
        process = [r["process"] for r in measured]
        trainer = [r["wall"] for r in measured if "wall" in r]
        finals = " ".join(_final(r["metric"]) for r in measured)
        rows.append(
            [
                model,
                _spread(process),
                _ratio(process, [r["process"] for r in runs[ref]]),
                " ".join(f"{w / r['process']:.2f}" for w, r in zip(process, runs[ref])),
                _spread(trainer),
                _ratio(trainer, [r["wall"] for r in runs[ref]]),
                "n/a" if model == peer_row else f"{statistics.median(r['first'] for r in measured):.1f}",
                f"{1000 * statistics.median(r['step'] for r in measured):.1f}",
                finals + (f" (step {measured[-1]['metric_step']})" if "metric_step" in measured[-1] else ""),
            ]
        )
        if args.cache == "cold":
            rows[-1].append(_spread([r["rerun"] for r in measured if "rerun" in r]))
    title = (
        f"whole runs: geoattn train --task {args.task} {' '.join(extra)}".rstrip()
        + f", {args.cache} compile cache, {args.repeats} run(s) per model in turn, runs in {out}"
    )
    headers = [
        "model", "process s min / med / max", f"× {ref}", "per run", "trainer s min / med / max", f"× {ref}",
        "first step s", "step ms", "final",
    ]  # fmt: skip
    if args.cache == "cold":
        headers.append("rerun s min / med / max")
    notes = [
        "process: each run's whole process, from its start to its exit (start-up, data, compile, "
        "evaluation, checkpoints, plots), as a user waits for it; trainer: the run's own wall_s (training "
        "and evaluation, without start-up and the final plots); first step: with its compile.",
    ]
    if args.cache == "cold":
        notes.append(
            "cold: process is a user's first run (an empty compile cache); rerun the same run's whole "
            "process again on the cache it filled, as the user's second run (the difference: compiling)."
        )
    if peer is not None:
        notes += peer.notes(out)
    return title + "\n" + format_table(headers, rows) + "\n" + "\n".join(notes)


def _final(metric: float | None) -> str:
    """A final metric: 4 decimals for losses, 3 significant digits for small errors (MSEs)."""
    if metric is None:
        return "n/a"
    return f"{metric:.4f}" if abs(metric) >= 0.01 else f"{metric:.3e}"


def _spread(values: list[float]) -> str:
    """``min / median / max`` in seconds, or ``n/a``."""
    if not values:
        return "n/a"
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"


def _ratio(values: list[float], ref: list[float]) -> str:
    return f"{statistics.median(values) / statistics.median(ref):.2f}" if values else "n/a"
