"""Hugging Face ``transformers`` integration (the ``geoattn[hf]`` extra).

``import geoattn.hf`` registers a config and a causal-LM class for every language model of the lm
task with ``AutoConfig`` / ``AutoModelForCausalLM``; ``geoattn export --out RUN --to DIR`` (or
:func:`export_run`) writes a run as a directory that ``from_pretrained`` loads::

    import geoattn.hf  # registers the geoattn model types
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained("hf/rt")
    tokenizer = AutoTokenizer.from_pretrained("hf/rt")
    ids = model.generate(**tokenizer("ROMEO:", return_tensors="pt"), max_new_tokens=100, do_sample=False)
    print(tokenizer.decode(ids[0]))

Without ``transformers`` installed, importing this package raises a one-line ConfigError naming the
extra.
"""

from geoattn.core.extras import require

require("transformers", extra="hf", purpose="geoattn.hf (Hugging Face models)")
require("tokenizers", extra="hf", purpose="geoattn.hf (Hugging Face tokenizers)")

from geoattn.hf.export import export_run  # noqa: E402
from geoattn.hf.modeling import (  # noqa: E402
    HF_CLASSES,
    GeoattnConfig,
    GeoattnForCausalLM,
    build_lm_model,
    hf_classes,
    register,
)
from geoattn.hf.tokenizer import char_tokenizer  # noqa: E402

register()

__all__ = [
    "GeoattnConfig",
    "GeoattnForCausalLM",
    "HF_CLASSES",
    "build_lm_model",
    "char_tokenizer",
    "export_run",
    "hf_classes",
    "register",
]
