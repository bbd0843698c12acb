"""The pointcloud task's models, one table: ``--model`` name → :class:`~geoattn.tasks.base.ModelRow`
(its config class, how to build it for the task's classes and cloud size, its recipe).

The networks live in :mod:`.networks` (the Transformer on point tokens, the rotor model) and
:mod:`.peers` (PointNet, DGCNN, VN-DGCNN). Every build reads the task's ``n_classes`` (16 generated
shapes, or the classes of the files read) and its ``config.points``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from geoattn.models.base import ModelSizes, TaskModel
from geoattn.models.lm import TransformerConfig
from geoattn.tasks.base import Follow, ModelRow, Recipe
from geoattn.tasks.pointcloud.networks import PointRotor, PointRotorConfig, PointTransformer, point_inputs
from geoattn.tasks.pointcloud.peers import DGCNN, VNDGCNN, DGCNNConfig, PointNet, PointNetConfig, VNConfig

# the rotor model's fixed shapes: Cl(3); its input widths follow model.neighbours (point_inputs), its
# scalar output is the model's full scalar width; 8 multivector channels out (their Gram readout)
ROTOR_IO = {"algebra": "cl3", "in_channels": 1, "in_scalars": 1, "out_channels": 8, "out_scalars": 1}
TRANSFORMER_FIXED = ("vocab_size", "block_size", "causal", "pos")


def build_transformer(task: Any, sizes: ModelSizes, options: dict[str, Any]) -> TaskModel:
    """The Transformer on point tokens: a set (no positions, not causal), one token per point."""
    config = TransformerConfig.from_sizes(
        sizes, options, vocab_size=1, block_size=task.config.points, causal=False, pos="none"
    )
    return PointTransformer(config, task.n_classes)


def build_rotor(task: Any, sizes: ModelSizes, options: dict[str, Any]) -> TaskModel:
    """The rotor model, its input widths from its input options (:func:`point_inputs`)."""
    config = PointRotorConfig.from_sizes(sizes, options, **ROTOR_IO)
    vectors, scalars = point_inputs(config)
    config = dataclasses.replace(config, in_channels=vectors, in_scalars=scalars, out_scalars=config.scalars)
    return PointRotor(config, task.n_classes)


def peer(config_class: Any, network: type[TaskModel]):
    """The build of a peer: its config from the run's sizes, the network for the task's classes."""

    def build(task: Any, sizes: ModelSizes, options: dict[str, Any]) -> TaskModel:
        return network(config_class.from_sizes(sizes, options), task.n_classes)

    return build


def recipe(lr: float, sizes: dict[str, Any], follows: tuple[Follow, ...] = ()) -> Recipe:
    """Every model's run: 800 steps of 32 clouds, one evaluation at the end, at ``lr``."""
    run = {"max_iters": 800, "batch_size": 32, "eval_interval": 800, "eval_iters": 4}
    return Recipe(settings={**run, "lr": lr, **sizes}, follows=follows)


# Sizes small enough for short runs on one CPU thread (rotor: frame heads, its fastest exact head type;
# DGCNN and VN-DGCNN: 4 edge layers, k = 10; VN's 10 vector channels hold as many numbers as DGCNN's 32
# channels); each at the rate it chose on validation from 1e-3, 2e-3, 4e-3, 8e-3
# (results/pointcloud-lr.md; z/z training).
TABLE: dict[str, ModelRow] = {
    "transformer": ModelRow(
        TransformerConfig,
        build_transformer,
        "Transformer on point tokens (centred xyz), mean-pooled; not rotation-invariant",
        recipe(2e-3, {"n_layer": 3, "n_head": 4, "n_embd": 64}),
        fixed=TRANSFORMER_FIXED,
    ),
    "rotor": ModelRow(
        PointRotorConfig,
        build_rotor,
        "RotorTransformer (Cl(3)) on points, invariant readout: rotation-invariant logits",
        recipe(
            8e-3,
            {
                "n_layer": 3,
                "n_head": 4,
                "n_embd": 128,
                # the local surface normals as a vector input: 0.753 → 0.810 validation accuracy at lr
                # 4e-3 (one seed; the principal axes' distances 0.776, both 0.799, normals with k = 8 or
                # 32 neighbours 0.786, 0.744, normals and bending 0.820; results/pointcloud.md)
                # gains on every block's outputs from 0.1 (CaiT's LayerScale): validation 0.856 ± 0.011
                # against 0.828 ± 0.016 without them, 6 seeds, p = 0.0054, each at the rate it chose on
                # the same grid (8e-3; results/pointcloud-layer-scale-recipe.md); experiments from
                # before pin layer_scale = "default" (no gains) in their cells
                "model_options": {"head_types": ["frame"] * 4, "normals": True, "layer_scale": 0.1},
            },
            # the normals come from the kNN: without neighbours the recipe reads none
            (Follow("model.neighbours", 0, {"model.normals": False}),),
        ),
        fixed=tuple(ROTOR_IO),
    ),
    "pointnet": ModelRow(
        PointNetConfig,
        peer(PointNetConfig, PointNet),
        "PointNet (shared MLP, max pooling; no transform nets); not rotation-invariant",
        recipe(1e-3, {"n_layer": 4, "n_embd": 64}),
    ),
    "dgcnn": ModelRow(
        DGCNNConfig,
        peer(DGCNNConfig, DGCNN),
        "DGCNN (EdgeConv on dynamic kNN graphs); not rotation-invariant",
        recipe(8e-3, {"n_layer": 4, "n_embd": 32}),
    ),
    "vn": ModelRow(
        VNConfig,
        peer(VNConfig, VNDGCNN),
        "VN-DGCNN (Vector Neurons): O(3)-equivariant layers, invariant logits",
        recipe(8e-3, {"n_layer": 4, "n_embd": 32}),
    ),
}
