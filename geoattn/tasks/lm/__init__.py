"""The ``lm`` task: language modelling (``task``) on local or registered texts (``datasets``)."""

from geoattn.tasks.lm.task import LMTask, read_text

__all__ = ["LMTask", "read_text"]
