"""The molecule task's network: a conservative, E(3)-equivariant energy model (:class:`RotorTransformer`).

Inputs ``x`` ``(B, N, 4)`` = [atomic number, position (Å)] per atom; prediction ``(B, N, 4)`` =
[molecule energy (eV, repeated on every atom), force (eV/Å)]; the target ``y`` has the same layout.
The energy is a sum of per-atom terms, the forces are ``−∂E/∂x`` by autograd (so they are conservative
and equivariant whenever E is invariant).

Why an embedding before the transformer: rotor attention weighs pairs by inner products of their
multivector features, which carry no interatomic distances unless the features do. Radial message
passing (``interactions`` SchNet-style continuous-filter updates of the scalars, summed over the
neighbours, then PaiNN's equivariant form ``Σ_j w(d_ij) r_ij`` for the vectors) gives every atom its
local environment; the transformer then attends over the whole molecule.
The embedding uses a smooth cut-off (Bessel basis × polynomial envelope, as DimeNet and MACE) so the
energy is smooth; attention is global: MD17 molecules have ≤ 21 atoms, so a neighbour list would not
pay. The embedding runs over the N(N − 1)/2 unordered pairs (its filters are symmetric in the two
atoms, the relative vectors antisymmetric): 22 % off the aspirin training step against all N² ordered
pairs (`geoattn bench step --task molecule`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from geoattn.core.errors import ConfigError
from geoattn.models.base import ModelSizes, TaskModel
from geoattn.models.rotor_transformer import RotorTransformer, RotorTransformerConfig
from geoattn.tasks.base import ModelRow, Recipe

if TYPE_CHECKING:
    from geoattn.tasks.molecule.task import MoleculeTask


@dataclass
class MoleculeModelConfig:
    """The energy model around the RotorTransformer (its ``model.*`` keys are the transformer's).

    Fields:
        rotor: the :class:`RotorTransformerConfig` (``in_channels = 1 + vectors``, ``in_scalars`` its
            scalar width, ``out_scalars = 1``: the per-atom energy).
        elements: atomic numbers the model knows (the data set's), in embedding order.
        cutoff: radius (Å) of the radial embedding; pairs beyond it do not enter it.
        n_rbf: Bessel radial basis functions.
        interactions: radial message-passing updates of the scalars before the transformer.
        vectors: equivariant vector channels from the radial message (besides the centred position).
        energy_weight, force_weight: the loss ``w_E · mean(ΔE²) + w_F · mean(ΔF²)`` (eV², (eV/Å)²).
    """

    rotor: RotorTransformerConfig
    elements: tuple[int, ...]
    cutoff: float = 5.0
    n_rbf: int = 8
    interactions: int = 3
    vectors: int = 4
    energy_weight: float = 0.01
    force_weight: float = 0.99

    def __post_init__(self) -> None:
        self.elements = tuple(int(z) for z in self.elements)
        if not self.elements or any(not 1 <= z <= 118 for z in self.elements):
            raise ConfigError(
                f"MoleculeModelConfig.elements must be atomic numbers 1..118, got {self.elements}"
            )
        if self.cutoff <= 0 or self.n_rbf < 1 or self.vectors < 1 or self.interactions < 0:
            raise ConfigError(
                f"MoleculeModelConfig: cutoff > 0, n_rbf ≥ 1, vectors ≥ 1, interactions ≥ 0 needed, got "
                f"{self.cutoff}, {self.n_rbf}, {self.vectors}, {self.interactions}"
            )
        if self.energy_weight < 0 or self.force_weight < 0 or self.energy_weight + self.force_weight == 0:
            raise ConfigError(
                f"MoleculeModelConfig: loss weights must be ≥ 0 and not both 0, got {self.energy_weight}, "
                f"{self.force_weight}"
            )


def pair_geometry(positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The unordered pairs ``i < j`` ``(2, P)`` (P = N(N − 1)/2, rows i and j), their relative vectors
    ``r_p = x_j − x_i`` ``(B, P, 3)`` and distances ``(B, P)``. Every pair function of the model is
    symmetric (the radial filters) or antisymmetric (``r``) in i and j, so one half of the N² ordered
    pairs carries it all: half the pair work, forward and through the force loss's double backward."""
    n = positions.shape[1]
    pairs = torch.triu_indices(n, n, 1, device=positions.device)
    rel = positions[:, pairs[1]] - positions[:, pairs[0]]
    return pairs, rel, torch.linalg.vector_norm(rel, dim=-1)


def pair_sum(values_i: Tensor, values_j: Tensor, pairs: Tensor, n: int) -> Tensor:
    """``out_i = Σ_{p = (i, j)} values_i[p] + Σ_{p = (j, i)} values_j[p]``: each unordered pair's term for
    its first atom added to that atom, its term for the second to the second. ``values_*`` ``(B, P, ...)``
    → ``(B, n, ...)``."""
    out = values_i.new_zeros((values_i.shape[0], n, *values_i.shape[2:]))
    return out.index_add(1, pairs[0], values_i).index_add(1, pairs[1], values_j)


def bessel_basis(dist: Tensor, cutoff: float, n_rbf: int) -> tuple[Tensor, Tensor]:
    """The radial basis ``sqrt(2/c) sin(kπd/c)/d`` (k = 1..n_rbf) ``(..., n_rbf)`` and the envelope
    ``1 − 6u⁵ + 15u⁴ − 10u³`` (u = d/c) ``(..., 1)``, C² at the cut-off c and 0 beyond (DimeNet, MACE)."""
    k = torch.arange(1, n_rbf + 1, dtype=dist.dtype, device=dist.device)
    d = dist[..., None]
    u = (d / cutoff).clamp(max=1.0)
    envelope = 1 - 6 * u**5 + 15 * u**4 - 10 * u**3
    return math.sqrt(2 / cutoff) * torch.sin(k * math.pi * d / cutoff) / d, envelope


class RadialFilter(nn.Module):
    """A filter ``(..., n_rbf)`` → ``(..., out)``: an MLP of the radial basis times the envelope (so it
    vanishes smoothly at the cut-off whatever the MLP's biases), as SchNet's filter-generating network."""

    def __init__(self, n_rbf: int, hidden: int, out: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_rbf, hidden), nn.SiLU(), nn.Linear(hidden, out))

    def forward(self, basis: Tensor, envelope: Tensor) -> Tensor:
        return self.net(basis) * envelope


class AtomEnvironment(nn.Module):
    """Radial message passing: invariant scalars and equivariant vectors of each atom's neighbourhood.

    ``h⁰_i = embed(z_i)``; ``interactions`` SchNet-style updates
    ``h_i ← h_i + MLP(Σ_j W_k(d_ij) ⊙ A_k h_j)``; then ``v_ic = Σ_j U(d_ij)_c G(h_j)_c r_ij``
    (W, U radial filters, A, G linear). Sums over the neighbours, as SchNet's: the envelope bounds
    them by the neighbourhood, and a mean over all N − 1 atoms (tried first) shrank every message
    ~20× on aspirin and trained slower. The vectors are
    equivariant (sums of relative positions with invariant weights), the scalars invariant.

    forward(positions ``(B, N, 3)``, types ``(B, N)`` long)
    → (scalars ``(B, N, S)``, vectors ``(B, N, V, 3)``).
    """

    def __init__(
        self, n_types: int, scalars: int, vectors: int, cutoff: float, n_rbf: int, interactions: int
    ):
        super().__init__()
        S = scalars
        self.cutoff, self.n_rbf = cutoff, n_rbf
        self.embed = nn.Embedding(n_types, S)
        self.filters = nn.ModuleList(RadialFilter(n_rbf, S, S) for _ in range(interactions))
        self.inputs = nn.ModuleList(nn.Linear(S, S, bias=False) for _ in range(interactions))
        self.updates = nn.ModuleList(
            nn.Sequential(nn.Linear(S, S), nn.SiLU(), nn.Linear(S, S)) for _ in range(interactions)
        )
        self.vector_filter = RadialFilter(n_rbf, S, vectors)
        self.vector_gate = nn.Linear(S, vectors)

    def forward(self, positions: Tensor, types: Tensor) -> tuple[Tensor, Tensor]:
        n = positions.shape[1]
        pairs, rel, dist = pair_geometry(positions)  # (2, P), (B, P, 3), (B, P)
        basis, envelope = bessel_basis(dist, self.cutoff, self.n_rbf)  # (B, P, K), (B, P, 1)
        h = self.embed(types).to(positions.dtype)  # (B, N, S)
        first, second = pairs
        for filt, inp, update in zip(self.filters, self.inputs, self.updates):
            w, a = filt(basis, envelope), inp(h)  # W(d_ij) = W(d_ji): (B, P, S), (B, N, S)
            h = h + update(pair_sum(w * a[:, second], w * a[:, first], pairs, n))
        u = self.vector_filter(basis, envelope)[..., None]  # (B, P, V, 1)
        g = self.vector_gate(h)[..., None]  # (B, N, V, 1)
        r = rel[:, :, None]  # (B, P, 1, 3); r_ji = −r_ij
        vectors = pair_sum(u * g[:, second] * r, -(u * g[:, first] * r), pairs, n)
        return h, vectors


class MoleculeRotor(TaskModel):
    """Energy and forces of a molecule: :class:`AtomEnvironment` → :class:`RotorTransformer` (Cl(3)) →
    per-atom energies summed; forces ``−∂E/∂x`` (see the module docstring).

    Multivector inputs per atom: the centred position and the ``vectors`` radial-message vectors (vector
    grade); scalars: the environment scalars. E(3): rotations and reflections act on every vector input
    alike (O(3)-equivariant layers, invariant scalar readout); translations cancel (centring and relative
    vectors). ``E = shift + scale · Σ_i e_i`` with ``shift`` the training set's mean energy and ``scale``
    its force RMS (buffers, saved with the weights), so the network's outputs start at unit size.

    forward(x ``(B, N, 4)``, y ``(B, N, 4)`` | None) → (prediction ``(B, N, 4)``, loss | None); forces are
    built with ``create_graph`` while training (the force loss needs second derivatives).
    """

    def __init__(self, config: MoleculeModelConfig, *, energy_shift: float = 0.0, energy_scale: float = 1.0):
        super().__init__()
        self.config = config
        rc = config.rotor
        if rc.algebra != "cl3" or rc.in_channels != 1 + config.vectors or rc.out_scalars != 1:
            raise ConfigError(
                f"MoleculeRotor needs a cl3 RotorTransformer with in_channels = {1 + config.vectors} and "
                f"out_scalars = 1, got {rc.algebra}, {rc.in_channels}, {rc.out_scalars}"
            )
        lookup = torch.full((119,), -1, dtype=torch.long)
        lookup[list(config.elements)] = torch.arange(len(config.elements))
        self.register_buffer("type_index", lookup, persistent=False)
        self.register_buffer("energy_shift", torch.tensor(float(energy_shift), dtype=torch.float64))
        self.register_buffer("energy_scale", torch.tensor(float(energy_scale), dtype=torch.float64))
        self.environment = AtomEnvironment(
            len(config.elements),
            rc.in_scalars,
            config.vectors,
            config.cutoff,
            config.n_rbf,
            config.interactions,
        )
        self.model = RotorTransformer(rc)
        self.algebra = self.model.algebra

    def types(self, numbers: Tensor) -> Tensor:
        """Embedding indices ``(B, N)`` of atomic numbers ``(B, N)`` (float or int); ValueError if unknown."""
        z = numbers.round().long()
        if z.min() < 0 or z.max() > 118 or (self.type_index[z] < 0).any():
            raise ValueError(
                f"MoleculeRotor knows elements {self.config.elements}, got {sorted(set(z.unique().tolist()))}"
            )
        return self.type_index[z]

    def energy(self, numbers: Tensor, positions: Tensor) -> Tensor:
        """Molecule energies ``(B,)`` (eV) of atomic numbers ``(B, N)`` at positions ``(B, N, 3)`` (Å)."""
        scalars, vectors = self.environment(positions, self.types(numbers))
        centred = positions - positions.mean(1, keepdim=True)
        mv = self.algebra.vector(torch.cat((centred[:, :, None], vectors), dim=2))  # (B, N, 1 + V, 8)
        _, atom_energy = self.model(mv, scalars)  # (B, N, 1)
        scale, shift = self.energy_scale.to(positions.dtype), self.energy_shift.to(positions.dtype)
        return shift + scale * atom_energy.sum((1, 2))

    def energy_and_forces(
        self, numbers: Tensor, positions: Tensor, *, create_graph: bool
    ) -> tuple[Tensor, Tensor]:
        """``(E (B,), F (B, N, 3) = −∂E/∂x)``; ``create_graph`` keeps F differentiable (for a force loss)."""
        # the fused CPU attention kernel has no double backward; the math one is made of plain ops
        with torch.enable_grad(), sdpa_kernel([SDPBackend.MATH]):
            positions = positions.detach().requires_grad_(True) if not positions.requires_grad else positions
            energy = self.energy(numbers, positions)
            (grad,) = torch.autograd.grad(energy.sum(), positions, create_graph=create_graph)
        return energy, -grad

    def forward(self, x: Tensor, y: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        check_molecule_batch(x, "x")
        numbers, positions = x[..., 0], x[..., 1:4]
        energy, forces = self.energy_and_forces(numbers, positions, create_graph=self.training)
        if not self.training:
            energy, forces = energy.detach(), forces.detach()
        prediction = torch.cat((energy[:, None, None].expand(-1, x.shape[1], 1), forces), dim=-1)
        return prediction, self.loss(prediction, y)

    def loss(self, prediction: Tensor, y: Tensor | None) -> Tensor | None:
        """``w_E · mean((E − E*)²) + w_F · mean((F − F*)²)`` (None without a target)."""
        if y is None:
            return None
        check_molecule_batch(y, "y", like=prediction)
        c = self.config
        energy_mse = (prediction[:, 0, 0] - y[:, 0, 0]).pow(2).mean()
        force_mse = (prediction[..., 1:] - y[..., 1:]).pow(2).mean()
        return c.energy_weight * energy_mse + c.force_weight * force_mse


def check_molecule_batch(x: Tensor, name: str, like: Tensor | None = None) -> None:
    """ValueError unless ``x`` is ``(B, N, 4)`` (and shaped like ``like``)."""
    if x.dim() != 3 or x.shape[-1] != 4:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected (B, N, 4)")
    if like is not None and x.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(like.shape)}")


# ------------------------------------------------------------------------------------ the table ----
# the rotor model's inputs and outputs besides its width: fixed by the embedding (see MoleculeRotor)
ROTOR_FIXED = ("algebra", "in_channels", "in_scalars", "out_channels", "out_scalars")


def rotor_config(task: MoleculeTask, sizes: ModelSizes, options: dict[str, Any]) -> MoleculeModelConfig:
    """The energy model's config: the run's sizes and ``model.*`` options, the task's embedding and loss
    weights (``task.*``) and the elements of its file."""
    c = task.config
    fixed = {
        "algebra": "cl3",
        "in_channels": 1 + c.vectors,
        "in_scalars": 1,
        "out_channels": 1,
        "out_scalars": 1,
    }
    rotor = RotorTransformerConfig.from_sizes(sizes, options, **fixed)
    rotor = dataclasses.replace(rotor, in_scalars=rotor.scalars)  # the embedding's width is the model's
    return MoleculeModelConfig(
        rotor=rotor,
        elements=tuple(sorted(set(task.trajectory.atomic_numbers.tolist()))),
        cutoff=c.cutoff,
        n_rbf=c.n_rbf,
        interactions=c.interactions,
        vectors=c.vectors,
        energy_weight=c.energy_weight,
        force_weight=c.force_weight,
    )


def build_rotor(task: MoleculeTask, sizes: ModelSizes, options: dict[str, Any]) -> MoleculeRotor:
    """:class:`MoleculeRotor` with the training split's mean energy and force RMS as its shift and scale."""
    shift, scale = task.energy_statistics()
    return MoleculeRotor(rotor_config(task, sizes, options), energy_shift=shift, energy_scale=scale)


TABLE: dict[str, ModelRow] = {
    "rotor": ModelRow(
        config=RotorTransformerConfig,
        build=build_rotor,
        description="radial embedding + RotorTransformer (Cl(3)), energy summed over atoms, forces −∂E/∂x",
        # chosen on aspirin with `geoattn bench molecule --rotor-set ...` probes (one seed, validation
        # force MAE): 64 environment scalars beat 16 and 128, lr 1e-2 beat 5e-3, and one rotor block
        # learned as fast per epoch as three at a fraction of the cost
        recipe=Recipe(
            settings={
                "lr": 1e-2,
                "n_layer": 1,
                "n_head": 4,
                "n_embd": 128,
                "batch_size": 10,
                "warmup_iters": 50,
                "weight_decay": 0.0,
                "model_options": {"scalars": 64},
            }
        ),
        fixed=ROTOR_FIXED,
    ),
}
