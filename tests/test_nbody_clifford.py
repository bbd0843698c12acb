"""The Clifford message-passing n-body model (``--model clifford``, CGENN's kind): E(3)-equivariance with
random rotations, reflections and shifts, its settings, and a short run on EGNN's own files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from geoattn.core.errors import ConfigError
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


def test_a_message_layer_reads_the_pairs_j_other_than_i_as_the_masked_mean_over_all_pairs():
    """The layer forms messages for the ordered pairs j ≠ i only (`other_bodies`); the same maths as
    messages over all n² pairs averaged with the self-pairs' weight 0 (its form before), in float64,
    values and parameter gradients."""
    from geoattn.tasks.nbody.bodies import mean_over_others, other_bodies
    from geoattn.tasks.nbody.clifford import CliffordMessageLayer, pair_geometry

    assert other_bodies(4).tolist() == [[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]]
    torch.manual_seed(1)
    model = NBodyCliffordGNN(CliffordGNNConfig(n_layer=1, channels=4, scalars=4)).double()
    layer, ga = model.layers[0], model.algebra
    B, n = 3, 5
    h, s = torch.randn(B, n, 4, 8, dtype=torch.float64), torch.randn(B, n, 4, dtype=torch.float64)
    c, x, v = torch.randn(B, n, 1).double(), torch.randn(B, n, 3).double(), torch.randn(B, n, 3).double()
    geometry, invariants = pair_geometry(ga, c, x, v)

    def all_pairs(self: CliffordMessageLayer, h, s, geometry, invariants):
        a, a_s = self.receiver(h, s)
        b, b_s = self.sender(h, s)
        g, g_s = self.geometry(geometry, invariants)
        m, t = a[:, :, None] + b[:, None] + g, a_s[:, :, None] + b_s[:, None] + g_s
        dm, dt = self.message_mlp(self.message_norm(m), self.message_scalar_norm(t))
        m, t = m + dm, t + dt
        mean = mean_over_others(n, t)
        m_mean, t_mean = (m * mean[..., None]).sum(2), (t * mean).sum(2)
        dh, ds = self.update(torch.cat((h, m_mean), -2), torch.cat((s, t_mean), -1))
        h, s = h + dh, s + ds
        dh, ds = self.node_mlp(self.node_norm(h), self.node_scalar_norm(s))
        return h + dh, s + ds

    results = []
    for forward in (layer.forward, lambda *args: all_pairs(layer, *args)):
        out_h, out_s = forward(h, s, geometry, invariants)
        loss = out_h.pow(2).sum() + out_s.pow(3).sum()
        results.append((out_h, out_s, *torch.autograd.grad(loss, list(layer.parameters()))))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


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
    from geoattn.training.recipes import build_config
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
