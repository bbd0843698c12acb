"""EGNN's own ``main_nbody.py`` on a directory of charged-particle files, as a peer run of an experiment.

Runs the EGNN authors' training script (their model, optimiser, data loader, evaluation) unchanged,
from a checkout of their repository, on the ``.npy`` files in ``--data`` (EGNN's layout:
``loc_train_charged5_initvel1small.npy`` …, written by their ``generate_dataset.py`` or by
``geoattn data make nbody-charged``), for a budget in optimiser steps (epochs of 3,000 / 100 = 30
steps each), and writes ``OUT/metrics.json``:

* ``val_mse_full``, ``test_mse``: EGNN's own protocol, the best validation MSE over its evaluations
  (every 5 epochs, each on the whole set) and the test MSE at that epoch;
* ``test_mse_last``: the test MSE at its last evaluation (no selection on validation);
* ``params``, ``wall_s`` (the whole script), ``steps``, ``epochs``, ``lr``, ``seed``, ``read_test``,
  ``command``.

The test files are read only with ``--read-test`` (or ``GEOATTN_READ_TEST=1``), as a confirmatory
experiment's runs read them. Sealed (the default), their script's test loader is given the validation
files under the test names (it loads and scores a test set every evaluation; the test files are never
opened, and an evaluation costs what it costs reading them), and ``metrics.json`` carries no test key:
``val_mse_last`` (the validation MSE at its last evaluation) stands where ``test_mse_last`` would.

Its script does not seed PyTorch; this runner does (``torch.manual_seed(seed)``) before calling it.
Run it with a Python that has torch (the project's environment will do)::

    python benchmarks/egnn_nbody.py --egnn ../peers/egnn --data DIR --out OUT --steps 3000 --seed 1
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
    print(f"egnn_nbody: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--egnn", required=True, help="checkout of EGNN's repository (has main_nbody.py)")
    parser.add_argument("--data", required=True, help="directory with EGNN's twelve .npy files")
    parser.add_argument("--out", required=True, help="directory for metrics.json and EGNN's logs")
    parser.add_argument("--steps", type=int, default=3000, help="optimiser steps (batch 100: 30 per epoch)")
    parser.add_argument("--lr", type=float, default=5e-4, help="EGNN's --lr (its default 5e-4)")
    parser.add_argument(
        "--weight-decay", type=float, default=1e-12, help="EGNN's --weight_decay (Adam's L2 term; 1e-12)"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--train-size", type=int, default=3000, help="EGNN's --max_training_samples")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: EGNN's own CUDA path")
    parser.add_argument("--force", action="store_true", help="overwrite an existing metrics.json")
    parser.add_argument("--read-test", action="store_true", default=os.environ.get(READ_TEST_ENV) == "1",
                        help=f"read the test files (default: sealed; or {READ_TEST_ENV}=1)")  # fmt: skip
    args = parser.parse_args(argv)
    command = [sys.executable, sys.argv[0], *(argv if argv is not None else sys.argv[1:])]

    egnn, data, out = Path(args.egnn).resolve(), Path(args.data).resolve(), Path(args.out).resolve()
    problem = peer_run_problem(egnn, "main_nbody.py", data, out, args.force)
    if problem:
        fail(problem)
    steps_per_epoch = args.train_size // 100
    if args.steps % steps_per_epoch:
        fail(f"--steps {args.steps} is not a whole number of epochs of {steps_per_epoch} steps")
    epochs = args.steps // steps_per_epoch

    # EGNN's script reads n_body_system/dataset/ relative to the working directory: a scratch folder
    # whose dataset/ links to the files, so the checkout stays untouched; sealed, the test names link to
    # the validation files (their script loads a test set unconditionally)
    work = out / "work"
    (work / "n_body_system" / "dataset").mkdir(parents=True, exist_ok=True)
    for (name, array), f in FILES.items():
        source = name if args.read_test or name != "test" else "val"
        link = work / "n_body_system" / "dataset" / f
        link.unlink(missing_ok=True)
        link.symlink_to(data / FILES[source, array])
    os.chdir(work)
    sys.path.insert(0, str(egnn))
    sys.argv = [
        "main_nbody.py",
        "--epochs", str(epochs),
        "--lr", str(args.lr),
        "--weight_decay", str(args.weight_decay),
        "--max_training_samples", str(args.train_size),
        "--exp_name", f"seed_{args.seed}",
        "--outf", str(out / "logs"),
        *(["--no-cuda"] if args.device == "cpu" else []),
    ]  # fmt: skip

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: no CUDA device is available")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    import main_nbody  # parses sys.argv at import, as when run as a script

    best_val, best_test, best_epoch = main_nbody.main()
    wall = time.perf_counter() - start
    losses = json.loads((out / "logs" / f"seed_{args.seed}" / "losess.json").read_text())
    # sealed, what their script calls its test losses are validation losses
    reads = (
        {"test_mse": best_test, "test_mse_last": losses["losess"][-1]}
        if args.read_test
        else {"val_mse_last": losses["losess"][-1]}
    )
    metrics = {
        "val_mse_full": best_val,
        **reads,
        "best_epoch": best_epoch,
        "params": None,
        "wall_s": wall,
        "steps": args.steps,
        "epochs": epochs,
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "seed": args.seed,
        "read_test": args.read_test,
        "device": args.device,
        "command": command,
    }
    model = main_nbody.EGNN_vel(in_node_nf=1, in_edge_nf=2, hidden_nf=64, n_layers=4, recurrent=True)
    metrics["params"] = sum(p.numel() for p in model.parameters())
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(json.dumps({k: v for k, v in metrics.items() if k != "command"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
