"""Rotor attention (docs/concepts/rotors.md), one module per concern, as `geoattn.attention.rt` is:

* `heads`: the head-type registry, the only place that knows a head's kind and which kernels run it;
* `params`: the parameterisation every head and path shares (tables, directions, logits, guard);
* `plan` and `sandwich`: the factorised sandwich of the rotation and reflection heads (its tables, its
  kernel); `projection`, `frame`: those heads' kernels; `compose`: the compose aggregation's kernel;
* `blocks`: the query blocks every fast kernel runs in (memory, compiled block kernels);
* `reference`: the pairwise oracle; `dispatch`: the table (`dispatch.PATHS`) that chooses the path;
* `functional`: `rotor_attention`; `qkv`: q, k and v per head group from the layers' projection.
"""

from geoattn.attention.rotor.functional import rotor_attention
from geoattn.attention.rotor.heads import (
    DEFAULT_HEAD_CYCLE,
    HEADS,
    HeadType,
    check_head_types,
    default_head_types,
    head_type_names,
    register_head_type,
    unregister_head_type,
)

__all__ = [
    "rotor_attention",
    "DEFAULT_HEAD_CYCLE",
    "HEADS",
    "HeadType",
    "check_head_types",
    "default_head_types",
    "head_type_names",
    "register_head_type",
    "unregister_head_type",
]
