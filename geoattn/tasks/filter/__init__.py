"""The ``filter`` task: the RT-SDE simulator (``simulator``), reference estimators (``estimators``), the
learned estimator's network (``models``) and the task (``task``)."""

from geoattn.tasks.filter.models import FilterModel
from geoattn.tasks.filter.simulator import FilterConfig, FilterSample, simulate
from geoattn.tasks.filter.task import FilterTask

__all__ = ["FilterConfig", "FilterSample", "FilterModel", "FilterTask", "simulate"]
