"""The ``nbody`` task (GATr's protocol): the simulator and GATr's file format (``simulator``), EGNN's
charged particles (``charged``), the networks (``models``, and the Clifford message-passing model in
``clifford``) and the task (``task``)."""

from geoattn.tasks.nbody.clifford import CliffordGNNConfig, NBodyCliffordGNN
from geoattn.tasks.nbody.models import NBodyRotor, NBodyRotorConfig, NBodyTransformer
from geoattn.tasks.nbody.simulator import (
    SETS,
    SIMULATED_SIZES,
    NBodyConfig,
    NBodySet,
    accelerations,
    initial_conditions,
    load_gatr_format,
    random_orthogonal,
    random_rotations,
    save_gatr_format,
    simulate_systems,
    symplectic_euler,
)
from geoattn.tasks.nbody.task import NBodyTask, equivariance_error

__all__ = [
    "CliffordGNNConfig",
    "NBodyCliffordGNN",
    "SETS",
    "SIMULATED_SIZES",
    "NBodyConfig",
    "NBodySet",
    "NBodyTask",
    "NBodyRotor",
    "NBodyRotorConfig",
    "NBodyTransformer",
    "accelerations",
    "equivariance_error",
    "initial_conditions",
    "load_gatr_format",
    "random_orthogonal",
    "random_rotations",
    "save_gatr_format",
    "simulate_systems",
    "symplectic_euler",
]
