"""RT-Filter attention (docs/concepts/rt-filter.md#the-logit, #kernels), one module per concern:

* `params`: the parameterisation every path shares (normalisation, transport, precision, logit);
* `reference`, `native_cpu`, `flex`, `chunked`: one module per path;
* `dispatch`: the table (`dispatch.PATHS`) that alone chooses the path of a call;
* `functional`: `rt_attention` and `rt_attention_qkv`.
"""

from geoattn.attention.rt.functional import rt_attention, rt_attention_qkv
from geoattn.attention.rt.params import log_noise_variance, rt_logits

__all__ = ["rt_attention", "rt_attention_qkv", "rt_logits", "log_noise_variance"]
