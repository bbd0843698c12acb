"""The contract between the trainer and a task (lm, filter, nbody, ...).

A task owns its data, its settings (``--set task.KEY=...``, a typed dataclass ``Settings``), the
networks it can train (``--model`` names) and its evaluation. The trainer owns everything else
(optimiser, schedule, checkpoints, DDP, logging). Batches are drawn from a ``torch.Generator`` that
the trainer seeds and checkpoints, so the data position resumes exactly and every DDP rank can draw
the same global batch and keep its own slice.

Adding a task is one module (or package) with a :class:`Task` subclass plus one line in
``geoattn.tasks.TASKS``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from geoattn.core.errors import ConfigError
from geoattn.core.settings import describe_settings, settings_from
from geoattn.models.base import ModelSizes, TaskModel


@dataclass
class EvalRow:
    """One line of ``geoattn eval``: a metric, its value, and what it was measured on."""

    metric: str
    value: float | str
    over: str  # e.g. "full val split (111,540 chars)", "20 batches of 12"


@dataclass(frozen=True)
class Follow:
    """A recipe default that follows an explicit choice: when the user sets ``option`` to ``value``,
    the recipe's ``then`` replaces the recipe's own values of those keys (the keys the user did not set).

    Keys are spelled as on the command line: ``model.KEY``, ``task.KEY`` or a run field (``lr``).
    Example: the n-body rotor recipe's Clifford block messages need Cl(3), so
    ``Follow("model.algebra", "pga", {"model.block_messages": "egnn"})``.
    """

    option: str
    value: Any
    then: dict[str, Any]


@dataclass(frozen=True)
class Recipe:
    """A model's best known run settings (measured; see results/): the defaults of ``geoattn train
    --task T --model M``, below anything the user sets, and which of them follow the user's choices."""

    settings: dict[str, Any] = field(default_factory=dict)
    follows: tuple[Follow, ...] = ()


@dataclass(frozen=True)
class ModelRow:
    """One row of a task's model table (``Task.table``: ``--model`` name → row).

    config: the dataclass behind the model's ``model.*`` keys.
    build: ``build(task, sizes, options) -> TaskModel``, the network at the run's sizes.
    description: one line, what ``--list-settings`` prints.
    recipe: its run defaults (:class:`Recipe`).
    compiles: whether its ``torch.compile``'d training step measured faster (the trainer's default).
    fixed: the config fields the task sets itself (not ``model.*`` keys).
    """

    config: type
    build: Callable[[Any, ModelSizes, dict[str, Any]], TaskModel]
    description: str
    recipe: Recipe = Recipe()
    compiles: bool = False
    fixed: tuple[str, ...] = ()


class Task(ABC):
    """One training problem.

    Subclasses set ``name``, ``table`` (``--model`` name → :class:`ModelRow`), ``Settings`` (a
    dataclass of the task's options; ``None`` if it has none) and implement :meth:`from_settings` and
    :meth:`get_batch`. ``models``, ``recipes``, ``compile_wins``, :meth:`model_settings` and
    :meth:`build_model` are derived from the table. A built model is a
    :class:`~geoattn.models.base.TaskModel`: ``model(x, y) -> (prediction, loss)``.
    """

    name: ClassVar[str]
    table: ClassVar[dict[str, ModelRow]] = {}
    Settings: ClassVar[type | None] = None
    description: ClassVar[str] = ""
    # the names of the sets that are test (held-out) data: an exploratory experiment seals them
    test_sets: ClassVar[tuple[str, ...]] = ("test",)
    # derived from ``table`` (__init_subclass__): --model name -> description, -> recipe settings,
    # and the models whose compiled step wins
    models: ClassVar[dict[str, str]] = {}
    recipes: ClassVar[dict[str, dict[str, Any]]] = {}
    compile_wins: ClassVar[frozenset[str]] = frozenset()
    # the model a run gets when it names none: the table's first row
    default_model: ClassVar[str] = "transformer"
    # the sets this run may not read (see :meth:`readable`); set by the trainer on an exploratory run
    sealed: frozenset[str] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "table" in cls.__dict__:
            cls.models = {name: row.description for name, row in cls.table.items()}
            cls.recipes = {
                name: row.recipe.settings for name, row in cls.table.items() if row.recipe.settings
            }
            cls.compile_wins = frozenset(name for name, row in cls.table.items() if row.compiles)
            cls.default_model = next(iter(cls.table))

    def readable(self, name: str) -> bool:
        """Whether this run may read set ``name`` (an exploratory experiment seals the test sets: a
        task computes no metric of a sealed set)."""
        return name not in self.sealed

    # ------------------------------------------------------------------ construction -------------
    @classmethod
    def from_options(
        cls,
        options: dict[str, Any] | None = None,
        *,
        data: str | None = None,
        block_size: int,
        meta: dict[str, Any] | None = None,
        load_data: bool = True,
    ) -> Task:
        """The task of a run: its ``task.*`` ``options`` checked against ``Settings``, then
        :meth:`from_settings`. ``data`` is the run's ``--data``, ``block_size`` its context (lm) or
        sequence length (filter); ``meta`` is a checkpoint's :meth:`meta` (lm: the vocabulary);
        ``load_data=False`` builds only what a loaded model needs (e.g. for sampling)."""
        options = options or {}
        if cls.Settings is None:
            if options:
                keys = ", ".join(f"task.{k}" for k in sorted(options))
                raise ConfigError(f"the {cls.name} task takes no task settings, got {keys}")
            settings = None
        else:
            defaults = cls.settings_defaults(data=data, block_size=block_size)
            settings = settings_from(cls.Settings, options, prefix="task", defaults=defaults)
        return cls.from_settings(settings, data=data, block_size=block_size, meta=meta, load_data=load_data)

    @classmethod
    def settings_defaults(cls, *, data: str | None, block_size: int) -> dict[str, Any]:
        """Settings that follow the run's flags unless set (filter: ``seq_len`` = ``--block-size``)."""
        return {}

    @classmethod
    @abstractmethod
    def from_settings(
        cls,
        settings: Any,
        *,
        data: str | None,
        block_size: int,
        meta: dict[str, Any] | None,
        load_data: bool,
    ) -> Task:
        """Build the task from its validated settings, the run's ``data`` and ``block_size``."""

    @classmethod
    def settings_table(cls, model: str | None = None) -> list[list[str]]:
        """Rows ``[key, type, default, help]`` of every ``task.*`` key, then ``model``'s ``model.*`` keys."""
        rows = describe_settings(cls.Settings, prefix="task") if cls.Settings is not None else []
        if model is not None:
            cls.check_model(model)
            config_cls, fixed = cls.model_settings(model)
            rows += describe_settings(config_cls, prefix="model", exclude=fixed)
        return rows

    @classmethod
    def model_settings(cls, model: str) -> tuple[type, tuple[str, ...]]:
        """The config dataclass behind ``model.*`` keys for ``model`` and the fields the task fixes."""
        row = cls.row(model)
        return row.config, row.fixed

    @classmethod
    def row(cls, model: str) -> ModelRow:
        """The table row of ``model``; ConfigError naming the task's models."""
        cls.check_model(model)
        return cls.table[model]

    @classmethod
    def check_model(cls, model: str) -> None:
        if model not in cls.models:
            raise ConfigError(f"the {cls.name} task supports models {', '.join(cls.models)}, not {model!r}")

    def build_model(self, model: str, sizes: ModelSizes, options: dict[str, Any] | None = None) -> TaskModel:
        """The network for ``--model model`` with the run's ``sizes`` and ``model.*`` ``options``."""
        self.check_model(model)
        return self._build(model, sizes, options or {})

    def _build(self, model: str, sizes: ModelSizes, options: dict[str, Any]) -> TaskModel:
        """The network ``model`` (already checked to be in ``models``): its row's ``build``."""
        return self.table[model].build(self, sizes, options)

    # ------------------------------------------------------------------ data and metrics ---------
    @abstractmethod
    def get_batch(
        self, split: str, batch_size: int, generator: torch.Generator, device: torch.device | str = "cpu"
    ) -> tuple[Tensor, Tensor]:
        """Draw ``(x, y)`` for ``split`` in {"train", "val", ...} with ``generator`` (on the CPU)."""

    def metrics(self, prediction: Tensor, y: Tensor) -> dict[str, float]:
        """Task metrics of one evaluation batch (averaged over batches by the trainer)."""
        return {}

    def meta(self) -> dict[str, Any]:
        """JSON-serialisable facts saved with every checkpoint (vocabulary, data source, settings)."""
        return {"task": self.name}

    def baselines(self, split: str = "val") -> dict[str, float]:
        """Reference numbers beside the learned models (e.g. the optimal filter), keyed by name."""
        return {}

    def final_metrics(self, model: TaskModel, device: torch.device) -> dict[str, float]:
        """Full-set metrics computed once at the end of training (lm: the whole validation split)."""
        return {}

    def prediction_rows(self, predictions: dict[str, Tensor]) -> list[EvalRow]:
        """The evaluation rows of a peer's predictions (what its own code predicted for every sample
        of the named sets, e.g. read from its ``predictions.npz``), measured as this task measures its
        own runs; ValueError for a task that reads none or a set it does not know."""
        raise ValueError(f"task {self.name!r} does not read a peer's predictions")

    def plots(self, model: TaskModel, directory: Path) -> list[Path]:
        """The task's own figures of a trained model, written at the end of a run as
        ``directory/task_*.png`` (cleared with the run's files by ``--force``); default: none."""
        return []

    def evaluation(
        self,
        model: TaskModel,
        device: torch.device,
        sampled: Callable[[], dict[str, float]],
        *,
        over: str,
    ) -> list[EvalRow]:
        """The rows of ``geoattn eval``: ``sampled()`` gives the trainer's batch estimates (measured
        ``over``, e.g. "20 batches of 12"); tasks add their full-set metrics and baselines (default:
        the estimates, the final metrics, baselines)."""
        rows = [EvalRow(k, v, over) for k, v in sampled().items()]
        full = self.final_metrics(model, device)
        rows += [EvalRow(k, v, "full set") for k, v in full.items()]
        rows += [EvalRow(f"baseline_{k}", v, "val pool") for k, v in self.baselines("val").items()]
        return rows

    def sample(self, model: TaskModel, prompt: str, **kwargs: Any) -> str:
        """Generate from a trained model (lm); other tasks have nothing to sample."""
        raise ConfigError(f"geoattn sample needs an lm run; this is a {self.name} run")
