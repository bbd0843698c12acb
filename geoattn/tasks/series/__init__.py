"""The ``series`` task: sets bundled inside sktime with points dropped at random (``data``), classifiers
that read the observation times (``models``) and the task (``task``)."""

from geoattn.tasks.series.task import SeriesConfig, SeriesTask

__all__ = ["SeriesConfig", "SeriesTask"]
