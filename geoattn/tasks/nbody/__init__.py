"""The ``nbody`` task (GATr's protocol): the simulator and GATr's file format (``simulator``), the networks
(``models``) and the task (``task``)."""

from geoattn.tasks.nbody.models import NBodyRotor, NBodyTransformer
from geoattn.tasks.nbody.simulator import (
    SETS,
    NBodyConfig,
    NBodySet,
    accelerations,
    initial_conditions,
    leapfrog,
    load_gatr_format,
    random_orthogonal,
    random_rotations,
    save_gatr_format,
    simulate_systems,
)
from geoattn.tasks.nbody.task import NBodyTask, equivariance_error

__all__ = [
    "SETS",
    "NBodyConfig",
    "NBodySet",
    "NBodyTask",
    "NBodyRotor",
    "NBodyTransformer",
    "accelerations",
    "equivariance_error",
    "initial_conditions",
    "leapfrog",
    "load_gatr_format",
    "random_orthogonal",
    "random_rotations",
    "save_gatr_format",
    "simulate_systems",
]
