"""The ``pointcloud`` task: parametric shapes generated here (``shapes``), the networks (``models``) and
the task with its rotation protocols (``task``)."""
