"""Train GATr's own n-body model with GATr's own experiment code, on given GATr-format files.

The peer run beside ``geoattn train --task nbody``: GATr's ``NBodyExperiment`` with its hydra config
(``config/nbody.yaml`` and ``config/model/{gatr,transformer}_nbody.yaml``), so model, optimiser (Adam),
lr schedule (exponential decay to ``lr_decay`` x lr, stepped every ``update_lr_every_n_steps``), loss
(MSE + output regularisation), gradient clipping, validation-based early stopping and evaluation are
GATr's. Overridden: data directory, steps, batch size, training samples (GATr's ``data.subsample``
fraction, which keeps a file's first samples), lr, seed, CPU for training and evaluation, no MLflow,
no progress bars during training.

Run with the GATr venv's python (see benchmarks/README.md)::

    python benchmarks/gatr_nbody.py --gatr /work/peers/gatr --data /work/data/nbody-gatr \\
        --out runs/gatr-s0 --lr 3e-4 --seed 0 --steps 2000 --batch-size 64 --train-size 1000

Writes ``OUT/metrics.json`` (flat: MSE on the full val, eval, e3_generalization and
object_generalization sets, parameters, walls, the settings and the command), ``OUT/predictions.npz``
(the trained model's predicted final positions ``(S, n, 3)`` for every sample of each set, the
training samples it saw included, keyed by set: what ``geoattn experiment`` reads sample by sample
when an experiment has ``evaluate = true``) and GATr's own run folder ``OUT/run/`` (config.yml,
output.log, models/, metrics/*.csv). ``--predict-only`` (with the run's own arguments) writes
``OUT/predictions.npz`` from the run's saved ``model_final.pt`` without training again. ``wall_s`` is
GATr's whole ``train()``, including its validation passes (``validate_s``, every
``validate_every_n_steps`` and once at the end); ``s_per_step`` excludes them and counts GATr's
``steps + 1`` optimiser steps (its loop runs steps 0..steps).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import gatr_shim
import numpy as np

SETS = ("train", "val", "eval", "e3_generalization", "object_generalization")
MODELS = {"gatr": "gatr_nbody", "transformer": "transformer_nbody"}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gatr", type=Path, required=True, help="GATr checkout (its repository root)")
    parser.add_argument("--data", type=Path, required=True, help="directory with GATr's five {set}.npz files")
    parser.add_argument("--out", type=Path, required=True, help="output directory (metrics.json, run/)")
    parser.add_argument("--lr", type=float, required=True, help="Adam learning rate (GATr's default 3e-4)")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--train-size", type=int, default=1000, help="first N samples of train.npz")
    parser.add_argument("--model", choices=sorted(MODELS), default="gatr",
                        help="GATr or GATr's Transformer baseline (config/model/{model}_nbody.yaml)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--log-every", type=int, default=250, help="progress line every N steps")
    parser.add_argument("--force", action="store_true", help="overwrite an existing OUT/metrics.json")
    parser.add_argument("--predict-only", action="store_true",
                        help="write OUT/predictions.npz from OUT/run/models/model_final.pt; no training")
    return parser.parse_args(argv)


def check_inputs(args: argparse.Namespace) -> tuple[str | None, int]:
    """The one-line problem with the arguments (or None), and the number of samples in train.npz."""
    problem = gatr_shim.check_gatr_checkout(args.gatr)
    if problem:
        return problem, 0
    if not args.data.is_dir():
        return f"no data directory {str(args.data)!r}; generate GATr's files (benchmarks/README.md)", 0
    for name in SETS:
        if not (args.data / f"{name}.npz").is_file():
            return f"data directory {str(args.data)!r} has no {name}.npz (GATr's sets: {', '.join(SETS)})", 0
    if args.predict_only:
        if not (args.out / "run" / "models" / "model_final.pt").is_file():
            return f"no trained model {str(args.out / 'run/models/model_final.pt')!r} to predict with", 0
        if (args.out / "metrics.json").is_file():  # the run's own settings, where it wrote them
            ran = json.loads((args.out / "metrics.json").read_text())
            given = (("--train-size", "train_size", args.train_size), ("--seed", "seed", args.seed),
                     ("--model", "model", args.model))
            for flag, key, value in given:
                if key in ran and ran[key] != value:
                    where = str(args.out / "metrics.json")
                    return f"{flag} {value} differs from the run's {ran[key]} ({where!r})", 0
    elif (args.out / "metrics.json").exists() and not args.force:
        return f"{str(args.out / 'metrics.json')!r} exists; pass --force to overwrite it", 0
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size),
                        ("--train-size", args.train_size), ("--threads", args.threads)):
        if value < 1:
            return f"{flag} is {value}, expected a positive integer", 0
    with np.load(args.data / "train.npz", mmap_mode="r") as npz:
        available = len(npz["x_initial"])
    if args.train_size > available:
        return f"--train-size {args.train_size} exceeds the {available} samples in train.npz", available
    return None, available


def git_commit(repo: Path) -> str:
    """The checked-out commit of ``repo``, or "unknown" outside git."""
    try:
        return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_predictions(experiment, out: Path, batch_size: int) -> dict[str, float]:
    """``out/predictions.npz``: the model's predicted final positions for every sample of each set
    (``train`` = the samples it trained on), in eval mode without gradients; returns each set's MSE
    from them (the check against GATr's own numbers)."""
    import torch

    experiment.model.eval()
    predictions, mse = {}, {}
    with torch.no_grad():
        for name in SETS:
            data = experiment._load_dataset(name)
            loader = experiment._make_data_loader(data, batch_size=batch_size, shuffle=False)
            parts, squared = [], 0.0
            for x, y in loader:
                y_pred, _ = experiment.model(x)
                parts.append(y_pred.double().numpy())
                squared += float(((y_pred.double() - y.double()) ** 2).sum())
            predictions[name] = np.concatenate(parts)
            mse[name] = squared / predictions[name].size
    partial = out / "predictions.npz.partial"  # moved in place when whole: no half file if killed
    with open(partial, "wb") as file:
        np.savez(file, **predictions)
    os.replace(partial, out / "predictions.npz")
    return mse


def main(argv: Sequence[str] | None = None) -> int:
    start = time.perf_counter()
    args = parse_args(argv)
    problem, available = check_inputs(args)
    if problem:
        print(f"gatr_nbody: {problem}", file=sys.stderr)
        return 2

    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # GATr trains on CUDA when it sees one; this run is on CPU
    gatr_shim.install(args.gatr)
    import gatr
    import gatr.utils.mlflow
    import torch
    from gatr.experiments.nbody import NBodyExperiment
    from hydra import compose, initialize_config_dir

    if not Path(gatr.__file__).resolve().is_relative_to(args.gatr.resolve()):
        print(f"gatr_nbody: imported gatr from {gatr.__file__}, not from {str(args.gatr)!r}", file=sys.stderr)
        return 2
    gatr.utils.mlflow.LOGGING_ENABLED = False
    torch.set_num_threads(args.threads)

    class Experiment(NBodyExperiment):
        """GATr's n-body experiment; progress goes to stdout instead of MLflow, validation is timed."""

        validate_s = 0.0
        last_validated_step = -1

        def _log(self, loss, metrics, grad_norm, step):
            if step % args.log_every == 0 or step == args.steps:
                elapsed = time.perf_counter() - train_start
                print(f"step {step:5d}  loss {loss.item():.3e}  grad-norm {grad_norm:.2e}  "
                      f"{(elapsed - self.validate_s) / (step + 1):.3f} s/step", flush=True)

        def validate(self, dataloader, step):
            began = time.perf_counter()
            super().validate(dataloader, step)
            self.validate_s += time.perf_counter() - began
            self.last_validated_step = step

    run_dir = (args.out / "run").resolve()
    overrides = [
        f"model={MODELS[args.model]}",
        f"base_dir={args.out.resolve()}",
        f"exp_dir={run_dir}",
        f"run_name={args.model}-seed{args.seed}",
        f"seed={args.seed}",
        f"data.data_dir={args.data.resolve()}",
        f"data.subsample={args.train_size / available!r}",
        f"training.steps={args.steps}",
        f"training.batchsize={args.batch_size}",
        f"training.lr={args.lr!r}",
        "training.eval_device=cpu",
        "training.progressbar=false",
    ]
    with initialize_config_dir(config_dir=str((args.gatr / "config").resolve()), version_base=None):
        cfg = compose(config_name="nbody", overrides=overrides)

    experiment = Experiment(cfg)
    if args.predict_only:
        experiment.load_model(str(run_dir / "models" / "model_final.pt"))
        mse = write_predictions(experiment, args.out, cfg.training.eval_batchsize)
        print("predictions written; MSE " + ", ".join(f"{k} {v:.4e}" for k, v in mse.items()), flush=True)
        return 0
    experiment._save_config()
    torch.random.manual_seed(cfg.seed)  # as GATr's BaseExperiment._initialize_experiment
    np.random.seed(cfg.seed)
    experiment.create_model()
    params = sum(p.numel() for p in experiment.model.parameters() if p.requires_grad)
    train_size = len(experiment._load_dataset("train"))
    if train_size != args.train_size:
        print(f"gatr_nbody: GATr kept {train_size} training samples, not {args.train_size}", file=sys.stderr)
        return 2
    print(f"GATr {gatr.__version__} ({git_commit(args.gatr)[:12]}) {args.model}: {params:,} parameters, "
          f"{train_size} training samples, {args.steps} steps x {args.batch_size}, lr {args.lr:g}, "
          f"seed {args.seed}, {args.threads} thread(s)", flush=True)

    train_start = time.perf_counter()
    experiment.train()
    wall_s = time.perf_counter() - train_start
    experiment.save_model("model_final.pt")

    if experiment._best_state["step"] == experiment.last_validated_step:
        mse = {"val": experiment.metrics["val"]["mse"]}  # GATr's closing validation, on this model
    else:  # early stopping went back to an earlier state
        val = experiment._load_dataset("val")
        loader = experiment._make_data_loader(val, batch_size=cfg.training.eval_batchsize, shuffle=False)
        mse = {"val": experiment._compute_metrics(loader)["mse"]}
    experiment.evaluate()
    for name in SETS[2:]:
        mse[name] = experiment.metrics[name]["mse"] if name in experiment.metrics else None

    metrics = {f"{name}_mse": value for name, value in mse.items()}
    metrics["val_mse_full"] = mse["val"]  # the name geoattn's own runs give the whole val set's MSE
    metrics.update(
        params=params,
        wall_s=round(wall_s, 2),
        validate_s=round(experiment.validate_s, 2),
        s_per_step=round((wall_s - experiment.validate_s) / (args.steps + 1), 4),
        total_wall_s=round(time.perf_counter() - start, 2),
        steps=args.steps,
        batch_size=args.batch_size,
        train_size=train_size,
        lr=args.lr,
        seed=args.seed,
        model=args.model,
        threads=args.threads,
        data=str(args.data.resolve()),
        gatr_commit=git_commit(args.gatr),
        xformers_shim_calls=gatr_shim.XFORMERS_CALLS,
        command=[sys.executable, *sys.argv] if argv is None else [sys.executable, __file__, *argv],
    )
    args.out.mkdir(parents=True, exist_ok=True)
    write_predictions(experiment, args.out, cfg.training.eval_batchsize)
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    scores = " ".join(f"{name} MSE {value:.3e}" for name, value in mse.items() if value is not None)
    print(f"{scores}; training {wall_s:.0f} s (validation {experiment.validate_s:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
