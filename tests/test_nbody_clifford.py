"""The Clifford message-passing n-body model (``--model clifford``, CGENN's kind): E(3)-equivariance with
random rotations, reflections and shifts, its settings, and a short run on EGNN's own files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from geoattn.errors import ConfigError
from geoattn.tasks.nbody import NBodyConfig, NBodyTask
from geoattn.tasks.nbody.clifford import CliffordGNNConfig, NBodyCliffordGNN
from geoattn.tasks.nbody.task import equivariance_error

EGNN_FILES = Path(__file__).parent / "data" / "egnn_charged"


@pytest.mark.parametrize(
    "system, options",
    [("charged", {}), ("gravity", {}), ("charged", {"paths": True, "gate": "grades"})],
)
def test_clifford_model_is_e3_equivariant(system, options):
    """float64: equivariant to rounding under random O(3) motions (reflections included) and shifts,
    CGENN's grade-path products and grade gates included; and the check is not blind (a fixed
    direction in the output breaks it)."""
    torch.manual_seed(0)
    model = NBodyCliffordGNN(CliffordGNNConfig(n_layer=2, channels=4, scalars=4, **options)).double()
    for p in model.read_out.parameters():  # it starts at zero (no motion): perturb it, so it acts
        p.data += 0.1 * torch.randn_like(p)
    for name, p in model.named_parameters():  # the path weights start at 1: move them off it
        if name.endswith("product.weight"):
            p.data += 0.5 * torch.randn_like(p)
    if system == "charged":
        x = NBodyTask(NBodyConfig(system="charged", data=str(EGNN_FILES))).dataset("train").inputs()
    else:
        x = NBodyTask(NBodyConfig(train_size=8, val_size=1, eval_size=1)).dataset("train").inputs()
    x = x.double()
    out, _ = model(x)
    assert (out - x[..., 1:4]).abs().max() > 1e-3  # it moves the bodies: the check below sees something
    generator = torch.Generator().manual_seed(1)
    assert equivariance_error(model, x, generator, shift_std=5.0) < 1e-11

    class Tilted(torch.nn.Module):
        def forward(self, x):
            out, _ = model(x)
            return out + torch.tensor([0.1, 0.0, 0.0], dtype=out.dtype), None

    assert equivariance_error(Tilted(), x, torch.Generator().manual_seed(1), shift_std=5.0) > 1e-3


def test_clifford_model_is_permutation_equivariant():
    torch.manual_seed(0)
    model = NBodyCliffordGNN(CliffordGNNConfig(n_layer=2, channels=4, scalars=4)).double()
    for p in model.read_out.parameters():  # it starts at zero (no motion): perturb it, so it acts
        p.data += 0.1 * torch.randn_like(p)
    x = torch.randn(3, 5, 7, dtype=torch.float64)
    perm = torch.tensor([3, 0, 4, 1, 2])
    out, _ = model(x)
    out_perm, _ = model(x[:, perm])
    torch.testing.assert_close(out_perm, out[:, perm], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("signed", [True, False])
def test_clifford_model_charge_flip(signed):
    """``signed_charges=False``: flipping every charge leaves the prediction unchanged (the dynamics'
    symmetry, float64); with the charges read signed it does not (the check is not blind)."""
    torch.manual_seed(0)
    config = CliffordGNNConfig(n_layer=2, channels=4, scalars=4, signed_charges=signed)
    model = NBodyCliffordGNN(config).double()
    for p in model.parameters():  # the read-out starts at zero (no motion); every weight perturbed
        p.data += 0.1 * torch.randn_like(p)
    x = NBodyTask(NBodyConfig(system="charged", data=str(EGNN_FILES))).dataset("train").inputs().double()
    flipped = x.clone()
    flipped[..., 0] = -flipped[..., 0]
    change = (model(flipped)[0] - model(x)[0]).abs().max()
    assert (change < 1e-12) if not signed else (change > 1e-4)


def test_clifford_config_reads_the_run_sizes_and_rejects_bad_values():
    from geoattn.models.base import ModelSizes

    config = CliffordGNNConfig.from_sizes(ModelSizes(n_layer=3, n_head=4, n_embd=128), {"scalars": 24})
    assert (config.n_layer, config.channels, config.scalars) == (3, 16, 24)
    with pytest.raises(ConfigError, match="channels"):
        CliffordGNNConfig(channels=0)
    with pytest.raises(ConfigError, match="gate must be one of scalar, grades"):
        CliffordGNNConfig(gate="relu")
    with pytest.raises(ValueError, match=r"\(B, n, 7\)"):
        NBodyCliffordGNN(CliffordGNNConfig(n_layer=1, channels=2, scalars=2))(torch.zeros(2, 5, 6))


def test_clifford_model_trains_on_the_charged_files(tmp_path):
    """A short run through the trainer on EGNN's own files: the test MSE beats the no-motion baseline."""
    from geoattn.recipes import build_config
    from geoattn.training.trainer import Trainer, run_task

    config = build_config(
        dict(task="nbody", model="clifford", data=str(EGNN_FILES), task_options={"system": "charged"},
             max_iters=60, batch_size=10, eval_interval=60, eval_iters=1, out=str(tmp_path / "run"),
             n_layer=2, n_embd=32, lr=3e-3, plots=False)
    )  # fmt: skip
    task = run_task(config)
    summary = Trainer(config, task, tmp_path / "run", verbose=False).train()
    assert summary["final"]["test_mse"] < task.baselines("test")["static_mse"]
    assert summary["final"]["equivariance_error"] < 1e-4
