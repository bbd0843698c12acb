"""The ``pointcloud`` task: parametric shapes generated here (``shapes``) or clouds read from files
(``data``), the networks (``networks``, ``peers``) in one model table (``models``), and the task with its
rotation protocols (``task``)."""
