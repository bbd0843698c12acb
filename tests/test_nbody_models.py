"""The nbody task's model table (``geoattn.tasks.nbody.models.TABLE``): one row per ``--model``, the
recipes' defaults that follow an explicit choice, and the builds that read the task."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from geoattn.core.errors import ConfigError
from geoattn.models.base import ModelSizes
from geoattn.tasks.nbody import NBodyConfig, NBodyRotor, NBodyTask, NBodyTransformer
from geoattn.tasks.nbody.models import TABLE
from geoattn.training.recipes import build_config

PACKAGE = Path(__file__).parents[1] / "geoattn" / "tasks" / "nbody"
TINY = ModelSizes(n_layer=1, n_head=2, n_embd=16)


def rotor_config(**model_options):
    """The run config of ``--task nbody --model rotor --set model.KEY=VALUE ...``."""
    return build_config({"task": "nbody", "model": "rotor", "model_options": model_options})


def test_every_model_is_a_row_and_the_task_reads_the_table():
    assert list(NBodyTask.models) == ["transformer", "rotor", "egnn", "clifford"]
    assert NBodyTask.models == {name: row.description for name, row in TABLE.items()}
    assert NBodyTask.recipes["rotor"]["lr"] == 4e-3 and NBodyTask.recipes["egnn"]["batch_size"] == 100
    assert NBodyTask.model_settings("transformer")[1] == ("vocab_size", "block_size", "causal", "pos")
    with pytest.raises(ConfigError, match="supports models transformer, rotor, egnn, clifford, not 'gatr'"):
        NBodyTask.row("gatr")


def test_no_branch_on_the_model_name_in_the_task_package():
    branch = re.compile(r"model (==|!=|in \()")
    found = [
        f"{path.name}:{number}"
        for path in sorted(PACKAGE.glob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if branch.search(line)
    ]
    assert found == []


def test_pga_alone_takes_egnn_messages_and_trains():
    """`--set model.algebra=pga`: the recipe's Clifford messages (Cl(3) only) follow it to EGNN's."""
    config = rotor_config(algebra="pga")
    assert config.model_options == {
        "scalars": 16, "pair_every_block": True, "block_messages": "egnn", "velocity_output": True,
        "algebra": "pga",
    }  # fmt: skip
    assert rotor_config().model_options["block_messages"] == "clifford"  # Cl(3): the recipe's own
    assert rotor_config(algebra="cl3").model_options["block_messages"] == "clifford"
    task = NBodyTask(NBodyConfig(train_size=8))
    model = task.build_model("rotor", TINY, config.model_options)
    assert isinstance(model, NBodyRotor) and model.algebra.r == 1  # PGA's null vector


def test_no_messages_before_the_blocks_takes_no_clifford_layer():
    config = rotor_config(pair_every_block=False)
    assert config.model_options["block_messages"] == "egnn"
    model = NBodyTask(NBodyConfig(train_size=8)).build_model("rotor", TINY, config.model_options)
    assert model.block_messages is None


@pytest.mark.parametrize(
    "options",
    [
        {"algebra": "pga", "block_messages": "clifford"},
        {"pair_every_block": False, "block_messages": "clifford"},
    ],
)
def test_an_error_only_when_the_user_sets_both_sides(options):
    config = rotor_config(**options)
    assert config.model_options["block_messages"] == "clifford"  # the user's, not the follow's
    task = NBodyTask(NBodyConfig(train_size=8))
    with pytest.raises(ConfigError, match="block_messages='clifford' needs algebra='cl3' and pair_every"):
        task.build_model("rotor", TINY, config.model_options)


def test_the_transformer_block_holds_the_most_bodies_of_the_tasks_sets(tmp_path):
    gravity = NBodyTask(NBodyConfig(object_planets=7, train_size=8))
    charged = NBodyTask(NBodyConfig(system="charged", particles=4))
    assert (gravity.bodies, charged.bodies) == (8, 4)
    model = gravity.build_model("transformer", TINY)
    assert isinstance(model, NBodyTransformer) and model.config.block_size == 8
    # files: the bodies they hold, whatever the simulator's settings say
    sizes = {"train_size": 4, "val_size": 4, "eval_size": 4, "e3_size": 4, "object_size": 4}
    NBodyTask(NBodyConfig(n_planets=2, object_planets=9, **sizes)).save_gatr_format(tmp_path)
    loaded = NBodyTask(NBodyConfig(data=str(tmp_path)))
    assert loaded.bodies == 10
    assert loaded.build_model("transformer", TINY).config.block_size == 10
