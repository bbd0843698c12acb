"""The peers of ``geoattn bench molecule``: MACE and SchNet, each trained by its own package's code.

Kept out of the installed ``geoattn`` package (its workarounds are for the peers' packages, not for
geoattn): ``geoattn bench molecule`` loads this file from the checkout it was installed from
(``geoattn.bench.molecule.peers``). Each runner takes the bench's :class:`MoleculeTask` (the same
file and split as the rotor model), a working directory, the bench's arguments and its epochs, and
returns ``params``, ``wall_s``, ``epochs`` and the MAEs on the full val and test splits, measured by
the same code as the rotor model's (``mae_metrics``).

* ``mace``: ``mace_run_train`` (mace-torch) on extended-XYZ exports of the same splits; the MACE paper's
  rMD17 recipe (r_max 5 Å, 2 interactions, correlation 3, batch 5, lr 0.01, AMSGrad, EMA, energy/force
  weights 1/1000, then the second (SWA) stage with weights 1000/100 for the last fifth of the epochs
  in runs of 5 or more) with fewer channels (``--mace-channels``, max_L 1).
* ``schnet``: SchNetPack 2.0's ``AtomisticTask`` + PyTorch Lightning on an ASE database of the same
  frames with our split file; SchNetPack's MD17 experiment (cut-off 5 Å, 20 Gaussians, AdamW lr 1e-3,
  batch 10, weights 0.01/0.99, ReduceLROnPlateau) with a smaller SchNet (``--schnet-width``,
  ``--schnet-interactions``; published: 128 wide, 6 interactions); evaluated, as SchNetPack's own
  ``spktrain`` tests, at its best validation epoch (its checkpoint on ``val_loss``, validated every
  epoch), as MACE's runner reads mace-torch's best checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import subprocess
import sys
import time
import typing
from pathlib import Path
from typing import Any

import numpy as np
import torch

from geoattn.core.errors import ConfigError, UserError
from geoattn.tasks.molecule.data import require
from geoattn.tasks.molecule.task import MoleculeTask, mae_metrics

# the published recipes' learning rates, used unless the arguments carry ``lr`` (the experiments' grids)
RECIPE_LR = {"mace": 1e-2, "schnet": 1e-3}


def _lr(args: argparse.Namespace, model: str) -> float:
    return getattr(args, "lr", None) or RECIPE_LR[model]


def _split_metrics(task: MoleculeTask, predict) -> dict[str, float]:
    """``{val,test}_{energy,force}_mae_mev`` of ``predict(x (F, N, 4) float64) -> (F, N, 4)``."""
    out = {}
    for split in filter(task.readable, ("val", "test")):
        x, y = task.split(split, torch.float64)
        for key, value in mae_metrics(predict(x), y).items():
            out[f"{split}_{key}"] = value
    return out


# ------------------------------------------------------------------------------- the handoff ----
# Both peers read the frames the rotor model reads: the task's (its one loader,
# geoattn.tasks.molecule.task.load_molecule_data, whatever the file's format), in eV, eV/Å and Å.
def frame_atoms(task: MoleculeTask, frames, *, labels: bool = True) -> list:
    """ASE Atoms of the task's ``frames`` (indices), with (``labels``) the reference energy / forces
    under ``REF_`` keys (MACE's convention)."""
    ase = require("ase")
    t = task.trajectory
    atoms = []
    for i in frames:
        a = ase.Atoms(numbers=t.atomic_numbers, positions=t.positions[i])
        if labels:
            a.info["REF_energy"] = float(t.energies[i])
            a.arrays["REF_forces"] = t.forces[i].copy()
        atoms.append(a)
    return atoms


def export_splits(task: MoleculeTask, out: Path) -> dict[str, Path]:
    """``out/{train,val,test}.xyz``: the task's splits as extended XYZ (MACE's training input)."""
    ase_io = require("ase.io")
    files = {}
    for split in ("train", "val", "test"):
        files[split] = out / f"{split}.xyz"
        ase_io.write(files[split], frame_atoms(task, task.indices[split]), format="extxyz")
    return files


def schnet_systems(task: MoleculeTask) -> tuple[list[dict[str, np.ndarray]], list]:
    """Every frame of the task as SchNetPack's ``add_systems`` takes them: properties (``energy``
    ``(1,)`` eV, ``forces`` ``(N, 3)`` eV/Å) and ASE Atoms; the task's split indices select from them."""
    t = task.trajectory
    properties = [{"energy": np.array([e]), "forces": f} for e, f in zip(t.energies, t.forces)]
    return properties, frame_atoms(task, range(len(t)), labels=False)


# ----------------------------------------------------------------------------------------- mace ----


def run_mace(task: MoleculeTask, out: Path, args: argparse.Namespace, epochs: int) -> dict[str, Any]:
    """``mace_run_train`` on extended-XYZ exports of the three splits, then our evaluation of its model."""
    require("mace")
    out = out.resolve()  # mace_run_train runs in `out`: every path it gets must be absolute
    out.mkdir(parents=True, exist_ok=True)
    files = export_splits(task, out)
    c = args.mace_channels
    command = [
        *_console_script("mace_run_train"),
        "--name=mace", f"--work_dir={out}", f"--train_file={files['train']}",
        f"--valid_file={files['val']}", "--energy_key=REF_energy", "--forces_key=REF_forces",
        "--E0s=average", "--model=MACE", f"--hidden_irreps={c}x0e + {c}x1o", "--max_L=1",
        "--r_max=5.0", "--num_interactions=2", "--correlation=3", "--batch_size=5",
        "--valid_batch_size=50", f"--max_num_epochs={epochs}", f"--lr={_lr(args, 'mace')}",
        "--energy_weight=1", "--forces_weight=1000", "--ema", "--ema_decay=0.99", "--amsgrad", "--device=cpu",
        "--default_dtype=float32", f"--seed={args.seed}", f"--eval_interval={max(1, epochs - 1)}",
        "--error_table=TotalMAE", "--plot=False", "--save_cpu",
    ]  # fmt: skip
    # mace_run_train evaluates (and checkpoints the model when its validation loss is the lowest so
    # far) after epochs i with i % eval_interval == 0, counting from 0, and saves its last checkpoint:
    # so the interval is epochs − 1 (after the first and the last epoch: the better of the two, and
    # the last one in a stage-two run, which resets the lowest loss), never epochs (then only epoch
    # 0's weights would be saved)
    stage_two = mace_stage_two(epochs)
    if stage_two:  # the recipe's second stage (energy weight 1000, forces 100, lr 1e-3) for the last epochs
        command += ["--swa", f"--start_swa={epochs - stage_two}"]
    threads = str(args.threads)
    # unbuffered: its log lines and warnings share one file, and the wall is read from the lines
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    with open(out / "train.log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out)
    command_wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"mace_run_train failed (exit {done.returncode}); see {out / 'train.log'}")
    name = "mace_stagetwo.model" if stage_two else "mace.model"
    model = torch.load(out / name, map_location="cpu", weights_only=False).float().eval()
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "wall_s": mace_training_wall(out / "train.log"),
        "command_wall_s": command_wall,
        "epochs": epochs,
        "stage_two_epochs": stage_two,
        **_split_metrics(task, lambda x: _mace_predict(model, task, x)),
    }


def mace_stage_two(epochs: int) -> int:
    """Epochs of MACE's second stage (its rMD17 recipe: the last ~20 % of training, with energy weight
    1000 and forces 100 at lr 1e-3, which fits the energy the first stage's 1 : 1000 weights leave
    off); none in runs under 5 epochs."""
    return epochs // 5 if epochs >= 5 else 0


def mace_training_wall(log: Path) -> float:
    """Seconds from mace_run_train's "Started training" to "Training complete" log lines: its
    training with its validation passes, as the other models' walls (not its start-up, data
    loading and final error tables)."""
    stamps = {}
    for line in log.read_text().splitlines():
        for key in ("Started training", "Training complete"):
            found = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+) INFO: " + key, line)
            if found and key not in stamps:
                stamps[key] = datetime.datetime.strptime(found[1], "%Y-%m-%d %H:%M:%S.%f")
    if len(stamps) != 2:
        raise RuntimeError(f"no training start / end lines in {log}: did mace_run_train change its log?")
    return (stamps["Training complete"] - stamps["Started training"]).total_seconds()


def _console_script(name: str) -> list[str]:
    """The command of an installed console script next to this interpreter (the venv's)."""
    path = Path(sys.executable).with_name(name)
    if not path.exists():
        raise ConfigError(
            f"{name} is not installed; install the 'molecules' extra: pip install 'geoattn[molecules]'"
        )
    return [str(path)]


def _mace_predict(
    model: torch.nn.Module, task: MoleculeTask, x: torch.Tensor, batch: int = 50
) -> torch.Tensor:
    """MACE's energies and forces ``(F, N, 4)`` for positions ``x`` through mace's own data pipeline."""
    data = require("mace.data")
    tools = require("mace.tools")
    ase = require("ase")
    z_table = tools.AtomicNumberTable([int(z) for z in model.atomic_numbers])
    r_max = float(model.r_max)
    numbers = task.trajectory.atomic_numbers
    configs = [
        data.config_from_atoms(ase.Atoms(numbers=numbers, positions=frame[:, 1:].numpy())) for frame in x
    ]
    graphs = [data.AtomicData.from_config(c, z_table=z_table, cutoff=r_max) for c in configs]
    loader = tools.torch_geometric.dataloader.DataLoader(graphs, batch_size=batch, shuffle=False)
    rows = []
    for item in loader:
        output = model(item.to_dict(), training=False, compute_force=True)
        energy = output["energy"].detach().double()
        forces = output["forces"].detach().double().view(-1, len(numbers), 3)
        rows.append(torch.cat((energy[:, None, None].expand(-1, len(numbers), 1), forces), -1))
    return torch.cat(rows)


# --------------------------------------------------------------------------------------- schnet ----
def import_schnetpack():
    """``schnetpack`` (2.0.x), after restoring a private typing alias that torch ≥ 2.5 dropped and
    schnetpack 2.0's data loader still imports (``torch.utils.data.dataloader.T_co``)."""
    import torch.utils.data.dataloader as dataloader

    if not hasattr(dataloader, "T_co"):
        dataloader.T_co = typing.TypeVar("T_co", covariant=True)
    return require("schnetpack")


def run_schnet(task: MoleculeTask, out: Path, args: argparse.Namespace, epochs: int) -> dict[str, Any]:
    """SchNetPack's AtomisticTask + Lightning on an ASE database of the file, with our split."""
    spk = import_schnetpack()
    pl = require("pytorch_lightning")
    torchmetrics = require("torchmetrics")
    out = out.resolve()  # (SchNetPack's split lock file lands in the working directory: we run in out)
    out.mkdir(parents=True, exist_ok=True)
    t = task.trajectory
    database = out / "frames.db"
    if database.exists():
        database.unlink()
    dataset = spk.data.ASEAtomsData.create(
        str(database), distance_unit="Ang", property_unit_dict={"energy": "eV", "forces": "eV/Ang"}
    )
    dataset.add_systems(*schnet_systems(task))
    split_file = out / "split.npz"
    np.savez(
        split_file,
        train_idx=task.indices["train"],
        val_idx=task.indices["val"],
        test_idx=task.indices["test"],
    )
    cutoff = 5.0
    module = spk.data.AtomsDataModule(
        str(database),
        batch_size=10,
        split_file=str(split_file),
        transforms=[
            spk.transform.SubtractCenterOfMass(),
            spk.transform.RemoveOffsets("energy", remove_mean=True),
            spk.transform.ASENeighborList(cutoff=cutoff),
            spk.transform.CastTo32(),
        ],
        num_workers=0,
        pin_memory=False,
    )
    with contextlib.chdir(out):
        module.prepare_data()
        module.setup()
    width = args.schnet_width
    representation = spk.representation.SchNet(
        n_atom_basis=width,
        n_interactions=args.schnet_interactions,
        radial_basis=spk.nn.GaussianRBF(n_rbf=20, cutoff=cutoff),
        cutoff_fn=spk.nn.CosineCutoff(cutoff),
    )
    model = spk.model.NeuralNetworkPotential(
        representation=representation,
        input_modules=[spk.atomistic.PairwiseDistances()],
        output_modules=[
            spk.atomistic.Atomwise(n_in=width, output_key="energy", aggregation_mode="sum"),
            spk.atomistic.Forces(energy_key="energy", force_key="forces"),
        ],
    )
    outputs = [
        spk.task.ModelOutput(
            name=key,
            loss_fn=torch.nn.MSELoss(),
            loss_weight=weight,
            metrics={"mae": torchmetrics.regression.MeanAbsoluteError()},
        )
        for key, weight in (("energy", 0.01), ("forces", 0.99))
    ]
    atomistic = spk.task.AtomisticTask(
        model=model,
        outputs=outputs,
        optimizer_cls=torch.optim.AdamW,
        optimizer_args={"lr": _lr(args, "schnet"), "weight_decay": 0.0},
        # SchNetPack's own ReduceLROnPlateau passes `verbose`, which torch 2.13 no longer takes; its MD17
        # settings (smoothing 0) make it torch's scheduler
        scheduler_cls=torch.optim.lr_scheduler.ReduceLROnPlateau,
        scheduler_args={"mode": "min", "factor": 0.5, "patience": 75, "threshold": 0.0, "cooldown": 10},
        scheduler_monitor="val_loss",
    )
    pl.seed_everything(args.seed, workers=True)
    # SchNetPack's spktrain keeps the model of the lowest validation loss and tests that one
    # (its callbacks/checkpoint.yaml, trainer.test(ckpt_path="best")): so do we
    best = pl.callbacks.ModelCheckpoint(dirpath=str(out / "checkpoints"), monitor="val_loss", mode="min")
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[best],
        enable_progress_bar=False,
        enable_model_summary=False,
        inference_mode=False,  # forces are gradients: validation needs autograd
        default_root_dir=str(out),
    )
    start = time.perf_counter()
    with contextlib.chdir(out):
        trainer.fit(atomistic, datamodule=module)
    wall = time.perf_counter() - start
    if not best.best_model_path:
        raise SystemExit(f"molecule_peers: SchNet saved no checkpoint in {out / 'checkpoints'}")
    checkpoint = torch.load(best.best_model_path, map_location="cpu", weights_only=False)
    atomistic.load_state_dict(checkpoint["state_dict"])
    best_epoch = int(checkpoint["epoch"]) + 1  # Lightning counts epochs from 0
    model.eval()
    n = len(t.atomic_numbers)
    predictions = {}
    for split, loader in (("val", module.val_dataloader()), ("test", module.test_dataloader())):
        rows, targets = [], []
        for batch in loader:
            # the model writes its outputs into the batch dict under the targets' keys: read those first
            target_e, target_f = batch["energy"].double().clone(), batch["forces"].double().clone()
            result = model(batch)
            energy, forces = result["energy"].detach().double(), result["forces"].detach().double()
            rows.append(torch.cat((energy[:, None, None].expand(-1, n, 1), forces.view(-1, n, 3)), -1))
            targets.append(torch.cat((target_e[:, None, None].expand(-1, n, 1), target_f.view(-1, n, 3)), -1))
        # both sides have the training mean energy removed (RemoveOffsets), so the differences are exact
        predictions[split] = mae_metrics(torch.cat(rows), torch.cat(targets))
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "wall_s": wall,
        "epochs": epochs,
        "best_epoch": best_epoch,
        **{f"{s}_{k}": v for s, metrics in predictions.items() for k, v in metrics.items()},
    }


# ------------------------------------------------------------------------------------------ cli ----
RUNNERS = {"mace": run_mace, "schnet": run_schnet}  # the models this file trains


def peer_task(data: Path, n_train: int | None, n_val: int | None, settings: list[str]) -> MoleculeTask:
    """The task a peer trains on: ``data`` with the split sizes and ``task.KEY=VALUE`` settings (the
    same ``task.*`` keys as ``geoattn train``); ConfigError for any other key."""
    from geoattn.training.config import parse_set

    parsed = parse_set(settings)
    other = sorted(set(parsed) - {"task_options"})
    if other:
        raise ConfigError(f"--set takes task.KEY=VALUE only, got {', '.join(other)}")
    options = dict(parsed.get("task_options", {}))
    options.update({k: v for k, v in (("n_train", n_train), ("n_val", n_val)) if v is not None})
    return MoleculeTask.from_options(options, data=str(data), block_size=0)


def main(argv: list[str] | None = None) -> int:
    """One peer training as an experiment's peer cell: ``--model`` on ``--data`` with the task's split,
    writing ``OUT/metrics.json`` (params, wall_s, epochs, lr and the MAEs on the full val and test
    splits, the mean predictor's beside them)::

        python benchmarks/molecule_peers.py --model mace --data aspirin.npz --out OUT --epochs 5
    """
    parser = argparse.ArgumentParser(prog="molecule_peers", description=main.__doc__.split("::")[0])
    parser.add_argument("--model", required=True, choices=RUNNERS)
    parser.add_argument(
        "--data",
        required=True,
        help="a molecule file: geoattn's, revised MD17's or sGDML's .npz, or extended XYZ",
    )
    parser.add_argument("--out", required=True, help="directory for metrics.json and the peer's files")
    parser.add_argument("--epochs", type=int, required=True, help="passes over the training set")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: the recipe's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-train", type=int, default=None, help="(default: the task's, rMD17's 1000)")
    parser.add_argument("--n-val", type=int, default=None, help="(default: the task's, rMD17's 1000)")
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="task.KEY=VALUE",
        help="the task's settings, as geoattn train --set (task.energy_key, task.splits_dir, ...)",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--mace-channels", type=int, default=32, help="MACE channels (paper: 256)")
    parser.add_argument("--schnet-width", type=int, default=64, help="SchNet n_atom_basis (published: 128)")
    parser.add_argument(
        "--schnet-interactions", type=int, default=3, help="SchNet interactions (published: 6)"
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing metrics.json")
    args = parser.parse_args(argv)
    out, data = Path(args.out), Path(args.data)
    if not data.is_file():
        print(f"molecule_peers: {data} does not exist (geoattn data make molecule)", file=sys.stderr)
        return 2
    if (out / "metrics.json").exists() and not args.force:
        print(f"molecule_peers: {out / 'metrics.json'} exists (--force overwrites)", file=sys.stderr)
        return 2
    if args.epochs < 1:
        print(f"molecule_peers: --epochs must be ≥ 1, got {args.epochs}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    try:
        task = peer_task(data, args.n_train, args.n_val, args.set)
        result = RUNNERS[args.model](task, out / args.model, args, args.epochs)
    except UserError as err:
        print(f"molecule_peers: {err}", file=sys.stderr)
        return 2
    baselines = {
        f"{split}_baseline_{k}": v for split in ("val", "test") for k, v in task.baselines(split).items()
    }
    metrics = {**result, "lr": _lr(args, args.model), "seed": args.seed, **baselines}
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
