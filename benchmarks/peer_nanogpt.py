"""nanoGPT's own ``train.py`` as a peer of `geoattn bench train --peer nanogpt`: its CPU recipe, run
from its checkout, through the drivers' protocol (``peer_protocol.py``: flags, check, plan, prepare, run).

nanoGPT reads ``data/<dataset>/`` and ``configurator.py`` relative to its working directory, so each
bench gets a work folder laid out as the checkout is: ``data/shakespeare_char/`` holds a copy of its
``prepare.py`` and our corpus as ``input.txt`` (so ``prepare.py`` finds it and downloads nothing), and
``prepare.py``, run there once, writes ``train.bin`` / ``val.bin`` / ``meta.pkl`` with nanoGPT's own
encoding; ``configurator.py`` and ``config/train_shakespeare_char.py`` are copied beside it. ``train.py``
and ``model.py`` run from the checkout, with this interpreter (so the same torch build); nothing is
written into the checkout.

Our ``geoattn train`` flags that reach nanoGPT (:data:`MAPPED`): ``--max-iters N`` (its
``--max_iters=N --lr_decay_iters=N``), ``--eval-interval``, ``--eval-iters``, ``--log-interval``, and
``--data`` (the corpus both sides read). :data:`OURS_ONLY` (``--compile``, ``--no-plots``) change how
our process runs, not the recipe. Any other flag would change one side's recipe only and is refused.
"""

from __future__ import annotations

import re
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from peer_protocol import Driver, main, timed_process

from geoattn.bench.common import flag_names, flag_value, git_revision
from geoattn.core.errors import ConfigError, DataError
from geoattn.tasks.lm.datasets import default_corpus, resolve_data

DATASET = "shakespeare_char"
CONFIG = "config/train_shakespeare_char.py"
# nanoGPT's README command for a CPU, at the lm recipe (docs/tasks.md#lm: 4 layers × 4 heads × 128, ctx 64)
RECIPE = (
    CONFIG, "--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1", "--block_size=64",
    "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
    "--lr_decay_iters=2000", "--dropout=0.0",
)  # fmt: skip
MAPPED: dict[str, Callable[[int], list[str]]] = {
    "--max-iters": lambda n: [f"--max_iters={n}", f"--lr_decay_iters={n}"],
    "--eval-interval": lambda n: [f"--eval_interval={n}"],
    "--eval-iters": lambda n: [f"--eval_iters={n}"],
    "--log-interval": lambda n: [f"--log_interval={n}"],
}
OURS_ONLY = ("--compile", "--no-plots")
NEEDED = ("train.py", "configurator.py", CONFIG, f"data/{DATASET}/prepare.py")
_EVAL = re.compile(r"^step (\d+): train loss ([-+\d.eE]+|nan), val loss ([-+\d.eE]+|nan)", re.MULTILINE)
_ITER = re.compile(r"^iter (\d+): loss \S+, time ([\d.]+)ms", re.MULTILINE)


def checkout(path: Path) -> Path:
    """``path`` if it holds the nanoGPT files the runs read (:data:`NEEDED`); else a one-line
    ConfigError saying how to get them."""
    if not all((path / name).is_file() for name in NEEDED):
        raise ConfigError(
            f"no nanoGPT checkout at {path} ({', '.join(NEEDED)}): "
            f"git clone https://github.com/karpathy/nanoGPT {path}, or pass --nanogpt DIR"
        )
    return path


def refuse_unmapped(argv: list[str]) -> None:
    """A one-line ConfigError naming the flags of ``argv`` that nanoGPT's run cannot follow."""
    refused = [f for f in flag_names(argv) if f not in MAPPED and f not in OURS_ONLY and f != "--data"]
    if refused:
        mapped = ", ".join([*MAPPED, "--data"])
        raise ConfigError(
            f"--peer nanogpt runs the same recipe on both sides; {', '.join(refused)} would change ours only "
            f"(flags that reach nanoGPT: {mapped}; ours only: {', '.join(OURS_ONLY)})"
        )


def recipe_args(values: dict[str, str]) -> list[str]:
    """``train.py``'s arguments: :data:`RECIPE`, then our mapped flags' ``values`` (by flag name)."""
    args = list(RECIPE)
    for flag, value in values.items():
        try:
            n = int(value)
        except ValueError:
            raise ConfigError(f"{flag} {value!r} is not a whole number") from None
        args += MAPPED[flag](n)
    return args


def prepare(repo: Path, corpus: Path, work: Path) -> Path:
    """Lay out ``work`` as the checkout (see the module docstring) and run ``prepare.py`` there on
    ``corpus``; its output goes to ``work/prepare.log``. Returns ``work``."""
    data = work / "data" / DATASET
    data.mkdir(parents=True)
    shutil.copyfile(repo / "data" / DATASET / "prepare.py", data / "prepare.py")
    shutil.copyfile(corpus, data / "input.txt")
    for name in ("configurator.py", CONFIG):
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(repo / name, work / name)
    with open(work / "prepare.log", "w") as log:
        cmd = [sys.executable, str(data / "prepare.py")]
        done = subprocess.run(cmd, cwd=data, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0 or not (data / "train.bin").is_file():
        tail = (work / "prepare.log").read_text().strip().splitlines()[-1:] or ["no output"]
        raise DataError(f"nanoGPT's prepare.py failed: {tail[0]} (log: {work / 'prepare.log'})")
    return work


def command(repo: Path, args: list[str], run_dir: Path) -> list[str]:
    """The ``train.py`` process of one run, writing its checkpoint to ``run_dir``."""
    return [sys.executable, str(repo / "train.py"), *args, f"--out_dir={run_dir}"]


def parse_log(text: str) -> dict[str, float]:
    """From a ``train.py`` log: its last evaluation's ``metric`` (val loss, estimated on ``eval_iters``
    batches) and ``metric_step``, and the median ``step`` in seconds of its ``iter N: ... time Xms``
    lines. ValueError if it has no evaluation line."""
    evals = _EVAL.findall(text)
    if not evals:
        raise ValueError("no 'step N: train loss X, val loss Y' line")
    step, _, val = evals[-1]
    times = [float(ms) / 1000 for _, ms in _ITER.findall(text)]
    return {
        "metric": float(val),
        "metric_step": int(step),
        "step": statistics.median(times) if times else float("nan"),
    }


def corpus_of(args: list[str]) -> Path:
    """The corpus both sides read: ``--data`` in ``args``, else ``$GEOATTN_CORPUS`` or the shared one."""
    data = flag_value(args, "--data")
    corpus = resolve_data(data) if data is not None else default_corpus()
    if not corpus.is_file():
        raise ConfigError(f"the corpus {corpus} is missing: pass -- --data FILE or set GEOATTN_CORPUS")
    return corpus.resolve()


def train_args(args: list[str]) -> list[str]:
    """``train.py``'s arguments for our ``geoattn train`` arguments ``args``."""
    return recipe_args({f: flag_value(args, f) for f in MAPPED if flag_value(args, f) is not None})


class NanoGPT(Driver):
    def flags(self) -> dict:
        reach = {flag: " ".join(make("N")) for flag, make in MAPPED.items()}
        reach["--data"] = "the corpus its prepare.py encodes"
        return {
            "row": "nanoGPT train.py",
            "task": "lm",
            "trains": "the lm task's recipe",
            "reach": reach,
            "ours_only": list(OURS_ONLY),
        }

    def check(self, repo: Path, python: Path | None) -> None:
        checkout(repo)

    def plan(self, repo: Path, python: Path | None, threads: int, out: Path, args: list[str]) -> dict:
        refuse_unmapped(args)
        corpus = corpus_of(args)
        ours = args if flag_value(args, "--data") is not None else [*args, "--data", str(corpus)]
        rev = git_revision(repo)
        cmd = " ".join(command(repo, train_args(args), out / "nanogpt_R"))
        notes = [
            "final: ours the val loss on the whole val split (val_loss_full); nanoGPT's the val loss it "
            "estimates on eval_iters batches at its last evaluation (the step shown: it evaluates every "
            "eval_interval steps from step 0, and trains steps 0 .. max_iters).",
            f"nanoGPT: cd {out / 'nanogpt'} && {cmd} (checkout {repo}{' at ' + rev if rev else ''}; "
            f"its data from its prepare.py on {corpus})",
        ]
        return {"ours": ours, "notes": notes}

    def prepare(self, repo: Path, out: Path, args: list[str]) -> None:
        prepare(repo, corpus_of(args), out / "nanogpt")

    def run(self, repo: Path, python: Path | None, threads: int, out: Path, args: list[str]) -> dict:
        cmd = command(repo, train_args(args), out)
        return timed_process("nanoGPT", cmd, out.parent / "nanogpt", out, parse_log)


if __name__ == "__main__":
    sys.exit(main(NanoGPT()))
