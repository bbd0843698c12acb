"""`geoattn bench train`: whole training runs, as a user starts them, against ``transformer``.

Each run is ``geoattn train --task TASK --model MODEL`` in its own process (the task's recipe unless
arguments after ``--`` change it), the models taken in turn ``--repeats`` times, so that a machine
that drifts slows every model alike. The table gives, per model, the trainer's wall time (from the
run's ``summary.json``: training and evaluation, without start-up and the final plots) as min /
median / max, its ratio to ``transformer``'s median, the first step (which compiles), the median step
and the final metric of each run.

``--cache`` sets what compilation costs: ``warm`` (default) gives each model one compile cache
(``TORCHINDUCTOR_CACHE_DIR``), filled by an untimed 3-step run first, as every run after a user's
first one finds it; ``cold`` gives every run an empty one, as a new user's first run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from geoattn.formatting import format_table

CACHES = ("warm", "cold")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's flags; arguments after ``--`` go to every `geoattn train` run."""
    parser.add_argument("--task", default="lm", help="the task whose recipe every run trains")
    parser.add_argument("--models", nargs="+", default=["transformer", "rt"], help="models, in turn")
    parser.add_argument("--repeats", type=int, default=2, help="runs per model")
    parser.add_argument("--cache", choices=CACHES, default="warm", help="compile cache of each run")
    parser.add_argument("--out", help="folder for the runs and caches (default: a new temporary one)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: `geoattn train` arguments")


def run(args: argparse.Namespace) -> int:
    """Train each model ``--repeats`` times in turn and print the table; 2 (one line) on bad input or
    a failed run, whose log it names."""
    extra = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if args.repeats < 1:
        print(f"error: --repeats must be at least 1, got {args.repeats}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="geoattn-bench-train-"))
    if out.exists() and any(out.iterdir()):
        print(f"error: --out {out} is not empty (nothing there is overwritten)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    base = ["train", "--task", args.task, *extra]
    # untimed: compiles the same graphs into each model's cache (a 3-step run compiles only if told)
    compile_flag = _flag_value(extra, "--compile")
    if args.cache == "warm" and compile_flag != "false":
        for model in args.models:
            prime = [*base, "--model", model, "--max-iters", "3", "--out", str(out / f"prime_{model}")]
            prime += ["--compile", "true"] if compile_flag is None else []
            if _train(prime, out / "cache" / model) != 0:
                return _failed(model, out / f"prime_{model}.log")
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in args.models}
    for r in range(args.repeats):
        for model in args.models:
            name = f"{model}_{r}"
            cache = out / "cache" / (model if args.cache == "warm" else name)
            if _train([*base, "--model", model, "--out", str(out / name)], cache) != 0:
                return _failed(model, out / f"{name}.log")
            runs[model].append(_measure(out / name))
    print(_table(runs, args, extra, out))
    return 0


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The last value given to ``flag`` in ``argv`` (``--flag value`` or ``--flag=value``), or None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _train(argv: list[str], cache: Path) -> int:
    """One `geoattn train` process with its own compile cache; its output goes to ``<out>.log``."""
    run_dir = Path(argv[argv.index("--out") + 1])
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    with open(f"{run_dir}.log", "w") as log:
        cmd = [sys.executable, "-m", "geoattn", *argv]
        return subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode


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


def _table(runs: dict[str, list[dict]], args: argparse.Namespace, extra: list[str], out: Path) -> str:
    peer = "transformer" if "transformer" in runs else next(iter(runs))
    peer_wall = statistics.median(r["wall"] for r in runs[peer])
    rows = []
    for model, measured in runs.items():
        walls = [r["wall"] for r in measured]
        rows.append(
            [
                model,
                f"{min(walls):.1f} / {statistics.median(walls):.1f} / {max(walls):.1f}",
                f"{statistics.median(walls) / peer_wall:.2f}",
                " ".join(f"{w / p['wall']:.2f}" for w, p in zip(walls, runs[peer])),
                f"{statistics.median(r['first'] for r in measured):.1f}",
                f"{1000 * statistics.median(r['step'] for r in measured):.1f}",
                " ".join("n/a" if r["metric"] is None else f"{r['metric']:.4f}" for r in measured),
            ]
        )
    title = (
        f"whole runs: geoattn train --task {args.task} {' '.join(extra)}".rstrip()
        + f", {args.cache} compile cache, {args.repeats} run(s) per model in turn, runs in {out}"
    )
    headers = ["model", "wall s min / med / max", f"× {peer}", "per run", "first step s", "step ms", "final"]
    return title + "\n" + format_table(headers, rows)
