"""molecule: the RotorTransformer against MACE and SchNet on the same MD17-style file and split

One molecule file (``geoattn data make molecule``, the task's settings), rMD17's split (``--n-train``
training, ``--n-val`` validation configurations, the rest test), and for every model a number of epochs
(passes over the training set: the same for all, or one per model to match their training wall times);
each trains with its own package's training code and its published MD17 recipe, scaled to a CPU:

* ``rotor``: ``geoattn``'s trainer on the molecule task (``MoleculeRotor``) with its row's recipe in
  the task's model table (batch 10, AdamW, lr 1e-2, cosine) and the energy/force MSE weights
  0.01/0.99 (SchNetPack's MD17 recipe).
* ``mace`` and ``schnet``: the peers' runners, ``benchmarks/molecule_peers.py`` in the checkout (not
  part of the installed package; its docstring gives both recipes), loaded by :func:`peers`; outside
  a checkout the bench runs ``--models rotor`` only and says so for the others.

Every model is then evaluated on the full validation and test splits with the same code
(energy MAE meV, force MAE meV/Å over components). Wall times are each training's own, its
validation passes included and its start-up, data preparation and final evaluation not (MACE's from
its log: "Started training" to "Training complete"), on one thread by default (``--threads``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from geoattn.core.errors import ConfigError
from geoattn.core.formatting import format_table
from geoattn.tasks.molecule.task import MoleculeTask

MODELS = ("rotor", "mace", "schnet")
# the peers' runners live beside the package in a checkout, not inside it
PEERS_FILE = Path(__file__).resolve().parents[2] / "benchmarks" / "molecule_peers.py"


def peers(path: Path | None = None) -> ModuleType:
    """The peers' runners (``run_mace``, ``run_schnet``), loaded from ``benchmarks/molecule_peers.py``
    of the checkout this package runs from; ConfigError in one line when there is none."""
    path = path or PEERS_FILE
    if not path.is_file():
        raise ConfigError(
            f"the mace and schnet runners are {path.name} in a geoattn checkout's benchmarks/ (not "
            f"installed with the package), and {path} does not exist: run from a checkout, or --models rotor"
        )
    spec = importlib.util.spec_from_file_location("geoattn_molecule_peers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``geoattn bench molecule``."""
    parser.add_argument("--name", default="aspirin", help="molecule (see geoattn data make molecule --help)")
    parser.add_argument(
        "--data",
        default=None,
        help="a molecule file: geoattn's, revised MD17's or sGDML's .npz, or extended XYZ (default: the "
        "cached default file)",
    )
    parser.add_argument(
        "--n-train",
        type=int,
        default=None,
        help="training configurations (default: the task's, rMD17's 1000)",
    )
    parser.add_argument(
        "--n-val",
        type=int,
        default=None,
        help="validation configurations (default: the task's, rMD17's 1000)",
    )
    parser.add_argument(
        "--epochs",
        nargs="+",
        default=["10"],
        metavar="N | MODEL=N",
        help="passes over the training set: one number for every model, or MODEL=N per model (e.g. "
        "rotor=60 schnet=40 mace=6, to give each about the same training wall time); default 10",
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS, help="models to run")
    parser.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads of every training")
    parser.add_argument("--out", default="runs/bench_molecule", help="working directory (runs, exports)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every training")
    parser.add_argument(
        "--rotor-set",
        nargs="*",
        default=[],
        help="the rotor run's TrainConfig fields (KEY=VALUE) and task / model settings (task.KEY=VALUE, "
        "model.KEY=VALUE) over the task's recipe (geoattn train --task molecule --model rotor); its task.* "
        "settings (e.g. task.energy_key, task.splits_dir) are every model's",
    )
    parser.add_argument("--mace-channels", type=int, default=32, help="MACE channels (paper: 256)")
    parser.add_argument("--schnet-width", type=int, default=64, help="SchNet n_atom_basis (published: 128)")
    parser.add_argument(
        "--schnet-interactions", type=int, default=3, help="SchNet interactions (published: 6)"
    )
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")


def model_epochs(values: list[str], models: list[str]) -> dict[str, int]:
    """``--epochs`` as ``{model: epochs}``: one number for all, or ``MODEL=N`` for each of ``models``.

    ConfigError (exit 2 on the command line) on a malformed entry, an unknown model or a missing one.
    """
    if len(values) == 1 and "=" not in values[0]:
        values = [f"{m}={values[0]}" for m in models]
    epochs = {}
    for entry in values:
        model, sep, number = entry.partition("=")
        if not sep or not number.isdecimal() or int(number) < 1:
            raise ConfigError(f"--epochs takes N or MODEL=N with N ≥ 1, got {entry!r}")
        if model not in MODELS:
            raise ConfigError(f"--epochs names model {model!r}; models are {', '.join(MODELS)}")
        if model in epochs:
            raise ConfigError(f"--epochs gives model {model!r} twice")
        epochs[model] = int(number)
    missing = [m for m in models if m not in epochs]
    if missing:
        raise ConfigError(f"--epochs gives no number for {', '.join(missing)}")
    return epochs


def run(args: argparse.Namespace) -> int:
    """Train every model of ``--models`` on the same file and split, then print the table."""
    epochs = model_epochs(args.epochs, args.models)
    user = rotor_overrides(args.rotor_set)  # a bad key fails before any training
    runners = {"rotor": run_rotor}
    if set(args.models) - {"rotor"}:
        module = peers()  # a missing checkout fails before any training too
        runners.update(module.RUNNERS)
    torch.set_num_threads(args.threads)
    # every model reads the same file and split: the rotor run's task settings are the bench task's
    task = MoleculeTask.from_options(
        {**user.get("task_options", {}), **split_options(args)}, data=args.data, block_size=0
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models:
        print(f"[bench molecule] training {name} ...", file=sys.stderr, flush=True)
        result = runners[name](task, out / name, args, epochs[name])
        rows.append({"model": name, **result})
        print(f"[bench molecule] {name}: {json.dumps(result)}", file=sys.stderr, flush=True)
    t = task.trajectory
    print(
        f"molecule {t.name} ({len(t.atomic_numbers)} atoms), {len(task.indices['train'])} train / "
        f"{len(task.indices['val'])} val / {len(task.indices['test'])} test frames, "
        f"{args.threads} thread(s); MAE on the full splits"
    )
    header = ["model", "params", "epochs", "wall (s)"]
    header += ["val E (meV)", "val F (meV/Å)", "test E (meV)", "test F (meV/Å)"]
    table = [
        [r["model"], f"{r['params']:,}", str(r["epochs"]), f"{r['wall_s']:.0f}"]
        + [f"{r[f'{s}_{k}']:.1f}" for s in ("val", "test") for k in ("energy_mae_mev", "force_mae_mev")]
        for r in rows
    ]
    print(format_table(header, table))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


# ---------------------------------------------------------------------------------------- rotor ----
# what --rotor-set may not change: the schedule follows --epochs / --seed / --out, the split the flags
ROTOR_SET_FIXED = ("max_iters", "eval_interval", "eval_iters", "log_interval", "plots", "seed", "out", "data")
ROTOR_SET_FIXED_TASK = ("name", "data", "n_train", "n_val", "split_seed")


def split_options(args: argparse.Namespace) -> dict[str, Any]:
    """The bench flags' ``task.*`` settings: the molecule and the split sizes it was given."""
    sizes = {k: getattr(args, k) for k in ("n_train", "n_val") if getattr(args, k) is not None}
    return {"name": args.name, **sizes}


def rotor_overrides(items: list[str]) -> dict[str, Any]:
    """``--rotor-set`` parsed as ``geoattn train --set`` (fields, task.KEY, model.KEY); ConfigError for
    the keys the bench sets for every model alike (the schedule, the split)."""
    from geoattn.training.config import parse_set

    user = parse_set(items)
    fixed = [k for k in ROTOR_SET_FIXED if k in user] + [
        f"task.{k}" for k in ROTOR_SET_FIXED_TASK if k in user.get("task_options", {})
    ]
    if fixed:
        raise ConfigError(f"--rotor-set cannot set {', '.join(fixed)}: the bench's flags set them")
    return user


def run_rotor(task: MoleculeTask, out: Path, args: argparse.Namespace, epochs: int) -> dict[str, Any]:
    """geoattn's trainer on the task with its rotor recipe (the task's model table) and
    ``--rotor-set`` on top: ``epochs · n_train / batch_size`` steps."""
    from geoattn.training.recipes import build_config
    from geoattn.training.trainer import Trainer, run_task

    user = rotor_overrides(args.rotor_set)
    run = {"task": "molecule", "model": "rotor", "data": args.data}
    split = {"task_options": split_options(args)}
    batch = build_config(run, user).batch_size  # the recipe's, or the user's
    steps = max(1, epochs * len(task.indices["train"]) // batch)
    schedule = {
        "max_iters": steps,
        "eval_interval": steps,
        "eval_iters": 5,
        "log_interval": 50,
        "plots": False,
        "seed": args.seed,
        "out": str(out),
    }
    config = build_config(run, split, user, schedule)
    torch.manual_seed(args.seed)
    # the run's own task: task.* settings (the embedding, the loss weights) live in the task's config
    trainer = Trainer(config, run_task(config), out, verbose=False)
    result = trainer.train()
    model = trainer.model
    return {
        "params": model.num_params(),
        "wall_s": result["wall_s"],
        "epochs": epochs,
        **{k: result["final"][k] for k in result["final"]},
    }
