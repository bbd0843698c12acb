"""CGENN's own n-body code (Ruhe et al. 2023, Clifford group equivariant networks) on a directory of
charged-particle files, as a peer run of an experiment.

Runs the CGENN authors' n-body pieces unchanged, from a checkout of their repository: their data
class (``data/nbody.py``: EGNN's loader, frames 30 → 40), their model (``models/nbody_cggnn.py``,
``NBodyCGGNN`` at its defaults: 3 layers of 28 multivector channels), their optimiser and schedule
(``nbody.py``: Adam with an L2 term, a cosine warm-up over 1/64 of the steps, a constant rate, a cosine
decay over the last quarter to 1e-7) and their trainer (``engineer.Trainer``: a validation pass every
``--val-interval`` steps, the test set read whenever the validation loss improves). Their published
command: lr 4e-3, weight decay 1e-4, batch 100, 3,000 training samples, 131,072 steps, validation every
128 steps. The files are EGNN's layout (``loc_train_charged5_initvel1small.npy`` …, written by EGNN's
``generate_dataset.py`` or by ``geoattn data make nbody-charged``). Writes ``OUT/metrics.json``:

* ``val_mse_full``, ``test_mse``: CGENN's own protocol, the lowest validation MSE over its validation
  passes (each on the whole set) and the test MSE read at that pass;
* ``test_mse_last``: the test MSE of the final model (no selection on validation);
* ``val_mse_last``: the validation MSE at the last validation pass;
* ``params``, ``wall_s`` (the whole run), ``steps``, ``lr``, ``weight_decay``, ``seed``, ``read_test``,
  ``command``.

The test files are read only with ``--read-test`` (or ``GEOATTN_READ_TEST=1``), as a confirmatory
experiment's runs read them. Sealed (the default), their data class is given the validation files under
the test names (it loads a test set unconditionally; the test files are never opened), their trainer
gets no test loader, and ``metrics.json`` carries no test key. A sealed run skips the test passes a
test-reading run makes at each new best validation pass, so its steps cost slightly less.

Two departures, neither touching the maths: the model stays on the CPU (``nbody.py`` moves it to CUDA
unconditionally), and the runner seeds Python, NumPy and PyTorch itself (their ``engineer.fire`` would,
from its config). Run it with a Python that has torch and scikit-learn (imported by their metrics
module; the project's environment has both)::

    python benchmarks/cgenn_nbody.py --cgenn ../peers/cgenn --data DIR --out OUT --steps 2130 --seed 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from geoattn.tasks.nbody.charged import egnn_file_names, peer_run_problem

FILES = egnn_file_names()  # {(set, array): file name} of EGNN's twelve .npy files
READ_TEST_ENV = "GEOATTN_READ_TEST"


def fail(message: str) -> None:
    print(f"cgenn_nbody: {message}", file=sys.stderr)
    raise SystemExit(2)


class _Record:
    """A logger for their trainer: keeps every validation and test loss with its step (prints nothing)."""

    def __init__(self) -> None:
        self.dir = None  # their checkpoint callback writes files only where a logger has a directory
        self.rows: list[tuple[int, str, float]] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        for key in ("val/loss", "test/loss"):
            if key in metrics:
                self.rows.append((step, key, float(metrics[key])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cgenn", required=True, help="checkout of CGENN's repository (has nbody.py)")
    parser.add_argument("--data", required=True, help="directory with EGNN's twelve .npy files")
    parser.add_argument("--out", required=True, help="directory for metrics.json")
    parser.add_argument("--steps", type=int, default=131072, help="optimiser steps (their 131,072)")
    parser.add_argument("--lr", type=float, default=4e-3, help="Adam's rate (their command: 4e-3)")
    parser.add_argument("--weight-decay", type=float, default=1e-4, help="Adam's L2 term (theirs: 1e-4)")
    parser.add_argument("--val-interval", type=int, default=128, help="steps between validation passes")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--train-size", type=int, default=3000, help="their --dataset.num_samples")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--force", action="store_true", help="overwrite an existing metrics.json")
    parser.add_argument("--read-test", action="store_true", default=os.environ.get(READ_TEST_ENV) == "1",
                        help=f"read the test files (default: sealed; or {READ_TEST_ENV}=1)")  # fmt: skip
    args = parser.parse_args(argv)
    command = [sys.executable, sys.argv[0], *(argv if argv is not None else sys.argv[1:])]

    cgenn, data, out = Path(args.cgenn).resolve(), Path(args.data).resolve(), Path(args.out).resolve()
    problem = peer_run_problem(cgenn, "models/nbody_cggnn.py", data, out, args.force)
    if problem:
        fail(problem)
    if args.steps < 64:
        fail(f"--steps {args.steps}: their schedule warms up over 1/64 of the steps (at least 64 needed)")

    # their loader reads $DATAROOT/nbody/: a scratch folder linking to the files; sealed, the test names
    # link to the validation files
    root = out / "dataroot"
    (root / "nbody").mkdir(parents=True, exist_ok=True)
    for (name, array), f in FILES.items():
        source = name if args.read_test or name != "test" else "val"
        link = root / "nbody" / f
        link.unlink(missing_ok=True)
        link.symlink_to(data / FILES[source, array])
    os.environ["DATAROOT"] = str(root)
    sys.path.insert(0, str(cgenn))

    import torch

    torch.set_num_threads(args.threads)
    from data.nbody import NBody
    from engineer.schedulers.cosine import CosineAnnealingLR
    from engineer.trainer.trainer import Trainer
    from engineer.utils.seed import set_seed
    from models.nbody_cggnn import NBodyCGGNN

    set_seed(args.seed)
    start = time.perf_counter()
    dataset = NBody(num_samples=args.train_size, batch_size=100)
    model = NBodyCGGNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    # as their nbody.py builds it
    scheduler = CosineAnnealingLR(
        optimizer, args.steps, warmup_steps=int(1 / 64 * args.steps), decay_steps=int(1 / 4 * args.steps)
    )
    record = _Record()
    trainer = Trainer(
        scheduler=scheduler,
        logger=record,
        max_steps=args.steps,
        val_check_interval=args.val_interval,
        print_interval=10**9,
        log_interval=10**9,
        callbacks=[],
    )
    test_loader = dataset.test_loader() if args.read_test else None
    trainer.fit(model, optimizer, dataset.train_loader(), dataset.val_loader(), test_loader)
    if args.read_test:
        trainer.test_loop(model, optimizer, test_loader, validation=False)  # the final model's test MSE
    wall = time.perf_counter() - start

    vals = [(step, v) for step, key, v in record.rows if key == "val/loss"]
    tests = [(step, v) for step, key, v in record.rows if key == "test/loss"]
    best_step, best_val = min(vals, key=lambda sv: sv[1])
    at_best = [v for step, v in tests[:-1] if step == best_step]
    reads = (
        {"test_mse": at_best[-1] if at_best else None, "test_mse_last": tests[-1][1]}
        if args.read_test
        else {}
    )
    metrics = {
        "val_mse_full": best_val,
        **reads,
        "best_step": best_step,
        "val_mse_last": vals[-1][1],
        "params": sum(p.numel() for p in model.parameters()),
        "wall_s": wall,
        "steps": args.steps,
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "val_interval": args.val_interval,
        "seed": args.seed,
        "read_test": args.read_test,
        "command": command,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(json.dumps({k: v for k, v in metrics.items() if k != "command"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
