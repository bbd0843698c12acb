"""The protocol between `geoattn bench train --peer NAME` and a peer's driver, ``benchmarks/peer_NAME.py``.

A driver runs a peer's own code from its checkout; `geoattn bench train` reaches it only through these
subcommands (ARGS: our `geoattn train` arguments, after ``--``), each run with our interpreter:

    flags                         JSON: {"row", "task", "trains", "reach": {our flag: how it reaches the
                                  peer}, "ours_only": [flags that change our process only]}
    check --checkout DIR [--python P]
                                  exit 2 and one line when the checkout (or the peer's venv) is missing
    plan --checkout DIR [--python P] --threads N --out OUT -- ARGS
                                  JSON: {"ours": ARGS with what both sides need added, "notes": [lines
                                  under the table]}; exit 2 and one line for a flag the peer cannot follow
    prepare --checkout DIR --out OUT -- ARGS
                                  the set-up in OUT before the first run (untimed)
    run --checkout DIR [--python P] --threads N --out RUN -- ARGS
                                  one run, its output in RUN.log; writes RUN.json: {"process": its whole
                                  process's wall, "step", "metric", and "wall", "metric_step" where the
                                  peer has them}; exit 2 and one line naming the log when it fails

A driver defines :class:`Driver`'s methods and calls :func:`main`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from geoattn.core.errors import UserError


class Driver:
    """A peer's side of the protocol; ``python`` is None unless ``--python`` was given."""

    def flags(self) -> dict:
        raise NotImplementedError

    def check(self, checkout: Path, python: Path | None) -> None:
        raise NotImplementedError

    def plan(self, checkout: Path, python: Path | None, threads: int, out: Path, args: list[str]) -> dict:
        raise NotImplementedError

    def prepare(self, checkout: Path, out: Path, args: list[str]) -> None:
        """Nothing to set up unless the driver says so."""

    def run(self, checkout: Path, python: Path | None, threads: int, out: Path, args: list[str]) -> dict:
        raise NotImplementedError


def timed_process(
    name: str, cmd: list[str], cwd: Path, run_dir: Path, parse: Callable[[str], dict[str, float]]
) -> dict[str, float]:
    """One timed peer process in ``cwd``, its output in ``<run_dir>.log``: its whole-process wall
    (``process``, seconds) and what ``parse(output)`` reads from the run; a one-line UserError naming
    the log if it fails or ``parse`` raises ValueError."""
    log_path = Path(f"{run_dir}.log")
    with open(log_path, "w") as log:
        start = time.perf_counter()
        code = subprocess.run(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT).returncode
        process = time.perf_counter() - start
    text = log_path.read_text()
    try:
        if code != 0:
            raise ValueError((text.strip().splitlines() or ["no output"])[-1])
        return {"process": process, **parse(text)}
    except ValueError as err:
        raise UserError(f"the {name} run failed: {err} (log: {log_path})") from None


def _run(driver: Driver, a: argparse.Namespace, args: list[str]) -> None:
    result = driver.run(a.checkout, a.python, a.threads, a.out, args)
    Path(f"{a.out}.json").write_text(json.dumps(result))


COMMANDS: dict[str, Callable[[Driver, argparse.Namespace, list[str]], None]] = {
    "flags": lambda driver, a, args: print(json.dumps(driver.flags())),
    "check": lambda driver, a, args: driver.check(a.checkout, a.python),
    "plan": lambda driver, a, args: print(
        json.dumps(driver.plan(a.checkout, a.python, a.threads, a.out, args))
    ),
    "prepare": lambda driver, a, args: driver.prepare(a.checkout, a.out, args),
    "run": _run,
}


def main(driver: Driver, argv: list[str] | None = None) -> int:
    """Parse a subcommand of the protocol and run it on ``driver``; 2 and one line on a UserError."""
    parser = argparse.ArgumentParser(description=(sys.modules["__main__"].__doc__ or "").split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("flags", help="which of our flags reach the peer and how (JSON)")
    for name in ("check", "plan", "prepare", "run"):
        p = sub.add_parser(name)
        p.add_argument("--checkout", type=Path, required=True, help="the peer's checkout")
        if name != "prepare":
            p.add_argument("--python", type=Path, help="the interpreter of the peer's venv, if it has one")
        if name in ("plan", "run"):
            p.add_argument("--threads", type=int, default=1, help="the threads our runs take")
        if name != "check":
            p.add_argument("--out", type=Path, required=True, help="the bench's folder (run: the run's)")
            p.add_argument("args", nargs=argparse.REMAINDER, help="after --: our `geoattn train` arguments")
    a = parser.parse_args(argv)
    args = getattr(a, "args", [])
    args = args[1:] if args[:1] == ["--"] else args
    try:
        COMMANDS[a.command](driver, a, args)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
