"""The RT-SDE (docs/concepts/rt-filter.md#the-rt-sde): simulator, closed-form angular variance and the shared
precisions."""

from geoattn.rt.precision import expm1_ratio, rfa_precision, rt_noise_variance
from geoattn.rt.sde import RTSDE, RTSDESample

__all__ = ["RTSDE", "RTSDESample", "expm1_ratio", "rfa_precision", "rt_noise_variance"]
