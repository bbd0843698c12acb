"""``transformers`` classes around the geoattn language models: one config and one causal LM per model.

A geoattn language model is any :class:`~geoattn.models.base.TaskModel` that the ``lm`` task builds
from a model name and that model's config dataclass (``forward(idx (B, T)) -> (logits (B, T, V),
loss)``). :class:`GeoattnForCausalLM` wraps one, rebuilt from the three things its
:class:`GeoattnConfig` stores: the model's config fields (``lm_config``), the character vocabulary
and the training context ``block_size``. Each name in ``LMTask.models`` gets its own pair of
subclasses (``GeoattnRtConfig`` / ``GeoattnRtForCausalLM`` for ``rt``, model type ``geoattn_rt``),
registered with ``AutoConfig`` and ``AutoModelForCausalLM`` when this module is imported, so a model
the lm task learns later is covered without code here.

Generation has no KV cache, on purpose: the geoattn attention layers have no incremental decoding
path, and like ``geoattn sample`` every new token re-runs the model on the last ``block_size`` tokens
with positions 0..T-1, so once the window slides every cached key would sit at a new position anyway.
The cost is O(block_size) per new token (what ``geoattn sample`` pays too), and HF ``generate`` with
``do_sample=False`` gives exactly ``geoattn sample --top-k 1``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from geoattn.core.errors import ConfigError
from geoattn.models.base import TaskModel

__all__ = [
    "GeoattnConfig",
    "GeoattnForCausalLM",
    "HF_CLASSES",
    "build_lm_model",
    "hf_classes",
    "register",
]


def _canonical(config: dict[str, Any]) -> str:
    """A config dict as sorted JSON, so tuples and lists (a JSON round trip) compare equal."""
    return json.dumps(config, sort_keys=True)


def build_lm_model(name: str, lm_config: dict[str, Any], vocab: str, block_size: int) -> TaskModel:
    """The lm task's model ``name`` with exactly the config fields ``lm_config`` (weights initialised).

    The task builds it (so every model the task knows is covered): the fields it fixes itself
    (vocabulary size, context) come from ``vocab`` and ``block_size``, every other field is passed as
    a ``model.*`` option. ConfigError if the built model's config differs from ``lm_config``.
    """
    from geoattn.models.base import ModelSizes
    from geoattn.models.lm import saved_config
    from geoattn.tasks.lm.task import LMTask

    LMTask.check_model(name)
    _, fixed = LMTask.model_settings(name)
    # an export from when one config held every model's fields carries them all
    lm_config = saved_config(name, lm_config)
    options = {k: v for k, v in lm_config.items() if k not in fixed}
    task = LMTask(None, block_size, vocab=vocab)
    model = task.build_model(name, ModelSizes(block_size=block_size), options)
    built = dataclasses.asdict(model.config)
    if _canonical(built) != _canonical(lm_config):
        differ = sorted(k for k in built.keys() | lm_config.keys() if built.get(k) != lm_config.get(k))
        raise ConfigError(f"the {name} model built from this config differs in {', '.join(differ)}")
    return model


class GeoattnConfig(PretrainedConfig):
    """The ``transformers`` config of a geoattn language model (base of the per-model configs).

    Fields (saved in ``config.json``):
        lm_config: the model's own config dataclass as a dict (``TransformerConfig``, ``RTConfig``,
            ``NGPTConfig``, ``RFAConfig`` fields, ...); what ``config.json``'s ``"model"`` section of a
            training run holds.
        vocab: the character vocabulary, id i is ``vocab[i]`` (the tokenizer's too).
        block_size: the training context T; generation feeds at most the last T tokens.
        vocab_size: ``len(vocab)``.

    The class attribute ``geoattn_model`` is the ``--model`` name; each subclass fixes one.
    """

    model_type = "geoattn"
    geoattn_model: ClassVar[str] = ""
    lm_config: dict | None = None
    vocab: str = ""
    block_size: int = 64
    vocab_size: int = 0

    @classmethod
    def from_model(cls, model: TaskModel, *, vocab: str, block_size: int) -> GeoattnConfig:
        """The config of a built geoattn model (its ``config`` dataclass) with the task's vocabulary."""
        return cls(
            lm_config=dataclasses.asdict(model.config),
            vocab=vocab,
            block_size=block_size,
            vocab_size=len(vocab),
        )


class GeoattnForCausalLM(PreTrainedModel, GenerationMixin):
    """A geoattn language model as a ``transformers`` causal LM (base of the per-model classes).

    ``forward(input_ids (B, T) long, attention_mask (B, T) | None, labels (B, T) | None)`` returns a
    ``CausalLMOutput`` with ``logits (B, T, V)`` (the geoattn model's own, unchanged) and, given
    ``labels``, the mean next-token cross-entropy (``labels`` shifted inside, -100 ignored, as every HF
    causal LM). The geoattn model is ``self.model``; the state dict keys are its own, prefixed
    ``model.``. Padding is not supported: an ``attention_mask`` with zeros raises ValueError.
    """

    config_class = GeoattnConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"

    def __init__(self, config: GeoattnConfig):
        super().__init__(config)
        name = type(config).geoattn_model
        if not name:
            raise ConfigError("use the config class of one model (e.g. GeoattnRtConfig), not GeoattnConfig")
        if config.vocab_size != len(config.vocab):
            raise ConfigError(f"vocab_size={config.vocab_size} but the vocabulary has {len(config.vocab)}")
        self.model = build_lm_model(name, config.lm_config or {}, config.vocab, config.block_size)
        # Buffers that are not saved (rotation frequencies, algebra tables) are functions of the
        # config; transformers' loader replaces them with empty tensors, from_pretrained puts these back.
        self._derived_buffers = {
            key: buffer.detach().clone() for key, buffer in self.named_non_persistent_buffers()
        }
        self.post_init()
        self.generation_config.use_cache = False

    # -------------------------------------------------------------- transformers' loading hooks ---
    @classmethod
    def get_init_context(cls, *args: Any, **kwargs: Any) -> list:
        """transformers' init contexts without the meta device: geoattn layers compute tables in
        ``__init__`` (real tensors needed) and a small model costs nothing to build for real."""
        contexts = super().get_init_context(*args, **kwargs)
        return [c for c in contexts if not (isinstance(c, torch.device) and c.type == "meta")]

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Nothing: the geoattn model initialises its own parameters when it is built."""

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        """``PreTrainedModel.from_pretrained``, then the derived (unsaved) buffers restored."""
        loaded = super().from_pretrained(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # output_loading_info=True
        for key, value in model._derived_buffers.items():
            owner, _, name = key.rpartition(".")
            module = model.get_submodule(owner)
            module._buffers[name] = value.to(module._buffers[name].device)
        return loaded

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # no KV cache (see the module docstring)

    # -------------------------------------------------------------- model --------------------------
    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutput:
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError(
                "geoattn language models take no padding (attention_mask has zeros): "
                "generate one prompt at a time, or prompts of one length"
            )
        logits, _ = self.model(input_ids)  # (B, T, V)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """The last ``block_size`` tokens, as ``geoattn sample`` feeds them (no cache to slice)."""
        T = self.config.block_size
        mask = None if attention_mask is None else attention_mask[:, -T:]
        return {"input_ids": input_ids[:, -T:], "attention_mask": mask}

    @classmethod
    def from_task_model(
        cls, model: TaskModel, *, name: str, vocab: str, block_size: int
    ) -> GeoattnForCausalLM:
        """The ``transformers`` model of the geoattn model ``name`` (e.g. a training run's), same weights.

        ``cls`` may be this base class: the subclass of ``name`` is used.
        """
        config_class, model_class = hf_classes(name)
        wrapped = model_class(config_class.from_model(model, vocab=vocab, block_size=block_size))
        wrapped.model.load_state_dict(model.state_dict(), strict=True)
        return wrapped.eval()


def _stem(name: str) -> str:
    return "Geoattn" + "".join(part.capitalize() for part in name.replace("-", "_").split("_"))


HF_CLASSES: dict[str, tuple[type[GeoattnConfig], type[GeoattnForCausalLM]]] = {}


def hf_classes(name: str) -> tuple[type[GeoattnConfig], type[GeoattnForCausalLM]]:
    """``(config class, model class)`` of the lm model ``name`` (created and registered on first use)."""
    if name not in HF_CLASSES:
        from geoattn.tasks.lm.task import LMTask

        LMTask.check_model(name)
        stem = _stem(name)
        config_class = type(
            f"{stem}Config",
            (GeoattnConfig,),
            {
                "__module__": __name__,
                "__doc__": f"``transformers`` config of the geoattn ``{name}`` language model.",
                "model_type": f"geoattn_{name}",
                "geoattn_model": name,
            },
        )
        model_class = type(
            f"{stem}ForCausalLM",
            (GeoattnForCausalLM,),
            {
                "__module__": __name__,
                "__doc__": f"The geoattn ``{name}`` language model as a ``transformers`` causal LM.",
                "config_class": config_class,
            },
        )
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)
        globals()[config_class.__name__] = config_class
        globals()[model_class.__name__] = model_class
        HF_CLASSES[name] = (config_class, model_class)
    return HF_CLASSES[name]


def register() -> dict[str, tuple[type[GeoattnConfig], type[GeoattnForCausalLM]]]:
    """Register every model of the lm task with ``AutoConfig`` / ``AutoModelForCausalLM``."""
    from geoattn.tasks.lm.task import LMTask

    for name in LMTask.models:
        hf_classes(name)
    return HF_CLASSES
