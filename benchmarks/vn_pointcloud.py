"""Vector Neurons' VN-DGCNN and DGCNN from their authors' code, trained on the pointcloud task's clouds.

The peer run beside ``geoattn train --task pointcloud --model vn|dgcnn``: the classes
``models/vn_dgcnn_cls.py`` and ``models/dgcnn_cls.py`` of the Vector Neurons repository (Deng et al.
2021), imported from a checkout of it (nothing of it is copied here), with the authors' loss (their
``get_loss``: cross-entropy with label smoothing 0.2) and optimiser recipe (their ``train_cls.py``:
SGD at ``--learning_rate`` x 100 = 0.1, momentum 0.9, weight decay 1e-4; or Adam at 1e-3), their
training augmentation (``provider.py``: random point dropout, scale in [0.8, 1.25], shift of ±0.1) and
their arguments (``--n_knn``, ``--pooling mean``). Run from the repository root::

    .venv/bin/python benchmarks/vn_pointcloud.py --vnn /work/peers/vnn --model vn_dgcnn \\
        --task-options '{"train_rotation": "z", "test_rotation": "so3"}' --seed 1 --out /tmp/vn \\
        --threads 1 --steps 800 --batch-size 32

The clouds. The runner builds geoattn's own pointcloud task from ``--task-options`` (and ``--data``),
the call the experiment runner makes, and draws every training batch as ``geoattn train`` does
(``task.get_batch("train", B, generator)``, the generator seeded by ``--seed``): the same clouds in the
same order, freshly rotated by the protocol's ``train_rotation``; the authors' ``--rot`` is the task's
protocol. Their points go in as ``(B, 3, P)``, as the authors' loader hands them.

The schedule (:data:`SCHEDULES`): ``cosine`` anneals the rate to ``--min-lr`` (1e-3) over the run's
steps, DGCNN's ``main_cls.py`` recipe (its cosine over epochs, here over steps); ``step`` is Vector
Neurons' ``train_cls.py`` (x 0.7 every 20 epochs of the training split, so constant over a run shorter
than 20 epochs).

The CPU. The authors' ``get_graph_feature`` puts its index offsets on ``torch.device('cuda')``; the
runner hands those two modules a ``torch`` whose ``device('cuda')`` is the CPU (:class:`CpuTorch`) and
calls no ``.cuda()``.

Evaluation is the task's own (:meth:`PointCloudTask.final_metrics`), on the authors' model in eval
mode: ``val_accuracy_full`` on every validation cloud always; ``test_accuracy``,
``test_accuracy_aligned``, ``_z`` and ``_so3`` only when the test split is readable, i.e. with
``--read-test`` (or ``GEOATTN_READ_TEST=1``): an exploratory run never reads it. ``OUT/metrics.json``
also has ``params``, ``wall_s`` (training and evaluation), ``s_per_step``, ``cpu_s_per_step`` (the
process's CPU time: the cost on a shared machine), ``eval_s``, ``train_loss_first`` and
``train_loss_last`` (means of the first and last 10 % of steps) and the numeric settings;
``OUT/settings.json`` every setting and the checkout's commit. No ``predictions.npz``: the pointcloud
task measures no peer's predictions (it has no ``prediction_rows``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import subprocess
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

READ_TEST_ENV = "GEOATTN_READ_TEST"


@dataclass(frozen=True)
class VnnModel:
    """One of the authors' classifiers: its module (``get_model``, ``get_loss``) and the module whose
    ``get_graph_feature`` asks for CUDA."""

    module: str
    graph_util: str
    description: str


MODELS = {
    "vn_dgcnn": VnnModel("models.vn_dgcnn_cls", "models.utils.vn_dgcnn_util",
                         "VN-DGCNN (vector neurons; invariant logits)"),
    "dgcnn": VnnModel("models.dgcnn_cls", "models.utils.dgcnn_util", "DGCNN (not rotation-invariant)"),
}  # fmt: skip


@dataclass(frozen=True)
class Optimiser:
    """The authors' optimiser: its default rate (``train_cls.py``'s 1e-3, x 100 for SGD) and builder."""

    lr: float
    build: Callable[[list[nn.Parameter], float, float], torch.optim.Optimizer]


OPTIMISERS = {
    "sgd": Optimiser(0.1, lambda ps, lr, wd: torch.optim.SGD(ps, lr=lr, momentum=0.9, weight_decay=wd)),
    "adam": Optimiser(1e-3, lambda ps, lr, wd: torch.optim.Adam(ps, lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                                                weight_decay=wd)),
}  # fmt: skip


def _cosine(optimizer: torch.optim.Optimizer, steps: int, steps_per_epoch: int, min_lr: float):
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps, eta_min=min_lr)


def _step(optimizer: torch.optim.Optimizer, steps: int, steps_per_epoch: int, min_lr: float):
    # train_cls.py: StepLR(step_size=20, gamma=0.7) stepped once per epoch
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.7 ** (s // (20 * steps_per_epoch)))


# name -> scheduler stepped once per optimiser step: (optimizer, steps, steps_per_epoch, min_lr)
SCHEDULES = {"cosine": _cosine, "step": _step}


class CpuTorch(types.ModuleType):
    """``torch`` for the authors' graph utilities: ``device('cuda')`` is the CPU, all else is torch."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def device(kind: str | torch.device, *args) -> torch.device:
        return torch.device("cpu") if str(kind).startswith("cuda") else torch.device(kind, *args)


def check_checkout(vnn: Path) -> str | None:
    """The one-line problem with a Vector Neurons checkout, or None when it has what the runner imports."""
    for row in MODELS.values():
        for module in (row.module, row.graph_util):
            needed = module.replace(".", "/") + ".py"
            if not (vnn / needed).is_file():
                return (f"no Vector Neurons checkout at {str(vnn)!r} (missing {needed}); clone "
                        "github.com/FlyingGiraffe/vnn there")  # fmt: skip
    if not (vnn / "provider.py").is_file():
        return f"no provider.py in {str(vnn)!r}: not a Vector Neurons checkout"
    return None


def import_vnn(vnn: Path, model: str) -> tuple[types.ModuleType, types.ModuleType]:
    """The authors' model module (``get_model``, ``get_loss``) and ``provider`` from the checkout
    ``vnn``, the graph utilities' CUDA device mapped to the CPU."""
    sys.path.insert(0, str(vnn.resolve()))
    row = MODELS[model]
    importlib.import_module(row.graph_util).torch = CpuTorch()
    return importlib.import_module(row.module), importlib.import_module("provider")


class TaskView(nn.Module):
    """The authors' classifier as the task calls its models: ``x (B, P, 3)`` → ``(logits (B, K), None)``
    (the authors' models read ``(B, 3, P)`` and return ``(logits, trans_feat)``)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: Tensor, y: Tensor | None = None) -> tuple[Tensor, None]:
        return self.net(x.transpose(1, 2))[0], None


def augment(x: Tensor, provider: types.ModuleType) -> Tensor:
    """``train_cls.py``'s augmentation of a training batch ``(B, P, 3)``: point dropout (dropped points
    set to the first), a random scale and a shift per cloud, by the authors' ``provider`` (NumPy's
    global generator, seeded by the runner)."""
    points = provider.random_point_dropout(x.numpy().copy())
    points[:, :, 0:3] = provider.random_scale_point_cloud(points[:, :, 0:3])
    points[:, :, 0:3] = provider.shift_point_cloud(points[:, :, 0:3])
    return torch.from_numpy(points).float()


def build_task(options: dict, data: str | None, read_test: bool):
    """geoattn's pointcloud task from its ``task.*`` options, its test split sealed unless ``read_test``."""
    from geoattn.tasks import get_task
    from geoattn.training.config import TrainConfig

    task = get_task("pointcloud", options, data=data, block_size=TrainConfig.block_size)
    if not read_test:
        task.sealed = frozenset(task.test_sets)
    return task


def run(args: argparse.Namespace) -> dict[str, float]:
    """Train the authors' ``args.model`` on the task's batches and measure it; the metrics written to
    ``OUT/metrics.json``."""
    from geoattn.core.errors import ConfigError

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    task = build_task(args.options, args.data or None, args.read_test)
    if args.k > task.config.points:
        raise ConfigError(f"--k {args.k} neighbours but the task's clouds have {task.config.points} points")
    vnn_module, provider = import_vnn(Path(args.vnn), args.model)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    vnn_args = argparse.Namespace(n_knn=args.k, pooling=args.pooling)
    model = TaskView(vnn_module.get_model(vnn_args, num_class=task.n_classes))
    criterion = vnn_module.get_loss()
    optimizer = OPTIMISERS[args.optimizer].build(list(model.parameters()), args.lr, args.weight_decay)
    steps_per_epoch = math.ceil(task.dataset("train")[0].shape[0] / args.batch_size)
    scheduler = SCHEDULES[args.schedule](optimizer, args.steps, steps_per_epoch, args.min_lr)
    generator = torch.Generator().manual_seed(args.seed)  # geoattn train's batch generator

    start, cpu_start = time.perf_counter(), time.process_time()
    losses = []
    model.train()
    for step in range(args.steps):
        x, y = task.get_batch("train", args.batch_size, generator)  # (B, P, 3), (B,)
        if args.augment == "authors":
            x = augment(x, provider)
        logits, _ = model(x)
        loss = criterion(logits, y, None)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if args.log_every and (step + 1) % args.log_every == 0:
            print(f"step {step + 1}: loss {np.mean(losses[-args.log_every :]):.4f}", flush=True)
    train_s, train_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    metrics = task.final_metrics(model, torch.device("cpu"))
    tail = max(1, len(losses) // 10)
    metrics.update(
        params=sum(p.numel() for p in model.parameters()),
        wall_s=time.perf_counter() - start,
        s_per_step=train_s / args.steps,
        # this process's CPU time: the step's cost on a machine other processes share
        cpu_s_per_step=train_cpu_s / args.steps,
        eval_s=time.perf_counter() - start - train_s,
        train_loss_first=float(np.mean(losses[:tail])) if losses else math.nan,
        train_loss_last=float(np.mean(losses[-tail:])) if losses else math.nan,
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, min_lr=args.min_lr,
        weight_decay=args.weight_decay, k=args.k, seed=args.seed, threads=args.threads,
    )  # fmt: skip
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    settings = {k: v for k, v in vars(args).items() if k != "options"}
    settings.update(vnn_commit=_commit(Path(args.vnn)), classes=list(task.classes))
    (out / "settings.json").write_text(json.dumps(settings, indent=2))
    return metrics


def _commit(repo: Path) -> str:
    """The checkout's commit, or "" when it is not a git work tree."""
    done = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def _json_object(text: str) -> dict:
    """``--task-options``: a JSON object of the task's options."""
    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text} is not a JSON object of task.* options")
    return value


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vnn", required=True, help="checkout of the Vector Neurons repository")
    models = "; ".join(f"{name}: {row.description}" for name, row in MODELS.items())
    parser.add_argument("--model", choices=sorted(MODELS), default="vn_dgcnn", help=models)
    parser.add_argument("--task-options", type=_json_object, default={},
                        help="the pointcloud task's task.* options, a JSON object")  # fmt: skip
    parser.add_argument("--data", default="", help="the pointcloud task's --data (empty: generated shapes)")
    parser.add_argument("--seed", type=int, default=1, help="initialisation, dropout, augmentation, batches")
    parser.add_argument("--out", required=True, help="directory for metrics.json and settings.json")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch-size", type=int, default=32, help="the authors' default 32")
    parser.add_argument("--optimizer", choices=sorted(OPTIMISERS), default="sgd", help="the authors' SGD")
    parser.add_argument("--lr", type=float, help="default: the optimiser's (SGD 0.1, Adam 1e-3)")
    parser.add_argument("--min-lr", type=float, default=1e-3, help="where cosine ends (DGCNN's 1e-3)")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="cosine")
    parser.add_argument("--weight-decay", type=float, default=1e-4, help="the authors' --decay_rate")
    parser.add_argument("--k", type=int, default=20, help="the authors' --n_knn: neighbours per point")
    parser.add_argument(
        "--pooling", choices=("mean", "max"), default="mean", help="VN-DGCNN's neighbour pooling"
    )
    parser.add_argument("--augment", choices=("authors", "none"), default="authors",
                        help="authors: train_cls.py's point dropout, scale and shift")  # fmt: skip
    parser.add_argument("--read-test", action="store_true", default=os.environ.get(READ_TEST_ENV) == "1",
                        help=f"read the test split (default: sealed; or {READ_TEST_ENV}=1)")  # fmt: skip
    parser.add_argument("--log-every", type=int, default=100, help="a loss line every N steps (0: none)")
    args = parser.parse_args(argv)
    args.options = args.task_options
    for name, least in (("steps", 1), ("batch_size", 2), ("k", 1), ("threads", 1)):  # BatchNorm: B ≥ 2
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} must be ≥ {least}, got {getattr(args, name)}")
    problem = check_checkout(Path(args.vnn))
    if problem:
        parser.error(problem)
    args.lr = OPTIMISERS[args.optimizer].lr if args.lr is None else args.lr
    return args


def main(argv: list[str] | None = None) -> int:
    from geoattn.core.errors import UserError

    try:
        metrics = run(parse(argv))
    except UserError as err:
        print(f"vn_pointcloud: {err}", file=sys.stderr)
        return 2
    print(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
