"""The Vector Neurons peer runner (benchmarks/vn_pointcloud.py): the authors' VN-DGCNN runs on the CPU
and its logits are invariant under O(3) (their classifier has no cross product), their DGCNN's are not;
a few steps of each on a tiny set write metrics.json, the test split only when readable."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from geoattn.bench.common import peers_dir
from geoattn.tasks.nbody.simulator import random_orthogonal, random_rotations

REPO = Path(__file__).resolve().parent.parent
VNN = (REPO / peers_dir() / "vnn").resolve()
RUNNER = REPO / "benchmarks" / "vn_pointcloud.py"
TINY = {"points": 24, "train_size": 48, "val_size": 16, "test_size": 16}

pytestmark = pytest.mark.skipif(
    not (VNN / "models" / "vn_dgcnn_cls.py").is_file(),
    reason=f"no Vector Neurons checkout at {VNN}: git clone github.com/FlyingGiraffe/vnn there "
    "(or a local snapshot of it), see benchmarks/vn_pointcloud.py",
)


@pytest.fixture
def vnn_runner():
    """The runner module, importing the authors' ``models`` package; ``sys.path`` and ``sys.modules``
    and torch's thread count restored afterwards (other peers' checkouts have a ``models`` package too)."""
    path, modules, threads = list(sys.path), set(sys.modules), torch.get_num_threads()
    sys.path.insert(0, str(RUNNER.parent))
    import vn_pointcloud

    yield vn_pointcloud
    sys.path[:] = path
    torch.set_num_threads(threads)
    for name in set(sys.modules) - modules:
        del sys.modules[name]


def _authors_model(runner, name: str, k: int = 6) -> torch.nn.Module:
    """The authors' classifier as the task calls it, in float64 and eval mode, its BatchNorm statistics
    those of a train-mode pass over random clouds (not the initial identity)."""
    module, _ = runner.import_vnn(VNN, name)
    torch.manual_seed(0)
    model = runner.TaskView(module.get_model(argparse.Namespace(n_knn=k, pooling="mean"), 5)).double()
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.momentum = None  # cumulative average: one pass sets the statistics
    model.train()
    with torch.no_grad():
        model(torch.randn(6, 24, 3, dtype=torch.float64))
    return model.eval()


def test_authors_vn_dgcnn_is_o3_invariant_on_the_cpu(vnn_runner):
    """The authors' VN-DGCNN (edge features [x_j − x_i, x_i], no cross product) gives the same logits
    for rotated and reflected clouds, float64."""
    model = _authors_model(vnn_runner, "vn_dgcnn")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 24, 3, generator=g, dtype=torch.float64)
    x = x - x.mean(1, keepdim=True)
    q = random_orthogonal(4, g)
    assert (torch.linalg.det(q) < 0).any() and (torch.linalg.det(q) > 0).any()
    with torch.no_grad():
        logits = model(x)[0]
        turned = model(torch.einsum("bij,bpj->bpi", q, x))[0]
    assert logits.shape == (4, 5)
    assert (turned - logits).abs().max() <= 1e-9 * logits.abs().max()
    assert logits.std(0).max() > 1e-4  # different clouds, different logits


def test_authors_dgcnn_is_not_invariant(vnn_runner):
    model = _authors_model(vnn_runner, "dgcnn")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 24, 3, generator=g, dtype=torch.float64)
    q = random_rotations(4, g)
    with torch.no_grad():
        moved = model(torch.einsum("bij,bpj->bpi", q, x))[0] - model(x)[0]
    assert moved.abs().max() > 1e-3


def _argv(out: Path, *extra: str) -> list[str]:
    return ["--vnn", str(VNN), "--task-options", json.dumps(TINY), "--seed", "3", "--out", str(out),
            "--threads", "1", "--steps", "3", "--batch-size", "8", "--k", "6", "--log-every", "0",
            *extra]  # fmt: skip


def test_a_few_steps_of_vn_dgcnn_as_the_experiment_runs_it(tmp_path):
    """The runner as a peer cell's command runs it (its own process): a few steps of the authors'
    VN-DGCNN on the task's tiny set; validation read, the test split sealed; the settings name the
    checkout's commit (a git checkout's)."""
    env = {k: v for k, v in os.environ.items() if k != "GEOATTN_READ_TEST"}
    command = [sys.executable, str(RUNNER), *_argv(tmp_path, "--model", "vn_dgcnn")]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["val_accuracy_full"] in {i / TINY["val_size"] for i in range(TINY["val_size"] + 1)}
    assert not any(key.startswith("test") for key in metrics)
    assert metrics["steps"] == 3 and metrics["params"] > 0 and metrics["s_per_step"] > 0
    assert all(isinstance(v, (int, float)) for v in metrics.values())
    settings = json.loads((tmp_path / "settings.json").read_text())
    assert settings["task_options"] == TINY
    assert re.fullmatch("[0-9a-f]{40}|", settings["vnn_commit"])  # empty for an exported (non-git) copy


def test_read_test_adds_every_rotation_of_the_test_split(vnn_runner, tmp_path, monkeypatch):
    monkeypatch.delenv("GEOATTN_READ_TEST", raising=False)
    assert vnn_runner.main(_argv(tmp_path, "--model", "dgcnn", "--read-test", "--schedule", "step")) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    tests = {"test_accuracy", "test_accuracy_aligned", "test_accuracy_z", "test_accuracy_so3"}
    assert tests <= set(metrics) and all(0 <= metrics[k] <= 1 for k in tests | {"val_accuracy_full"})
    # the default protocol is z/SO(3): test_accuracy is the SO(3) one
    assert metrics["test_accuracy"] == metrics["test_accuracy_so3"]


def test_bad_arguments_are_one_line(vnn_runner, tmp_path, capsys):
    assert vnn_runner.main(_argv(tmp_path, "--model", "dgcnn", "--k", "30")) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "--k 30 neighbours but the task's clouds have 24 points" in err
    with pytest.raises(SystemExit):
        vnn_runner.main(_argv(tmp_path, "--vnn", str(tmp_path)))
    assert "no Vector Neurons checkout" in capsys.readouterr().err
