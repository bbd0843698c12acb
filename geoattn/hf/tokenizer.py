"""The character vocabulary of an lm run as a tokenizer that ``AutoTokenizer`` loads.

A ``tokenizers`` pipeline saved as ``tokenizer.json``: every character is its own piece (a regex
split that keeps each match), each piece maps to its id in the vocabulary (``WordLevel``), and
decoding joins the pieces without separators (``Fuse``). No special tokens are added, so
``tokenizer(text).input_ids`` equals the lm task's ``encode(text)``; a character outside the
vocabulary is an error, as in the task. Loading needs ``transformers`` only, not geoattn.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = ["char_tokenizer"]


def char_tokenizer(vocab: str, *, block_size: int | None = None) -> PreTrainedTokenizerFast:
    """A fast tokenizer with id ``i`` for the character ``vocab[i]``.

    Args:
        vocab: the run's vocabulary (distinct characters, in id order).
        block_size: the model's training context, saved as ``model_max_length`` (a hint: the models
            also run on longer inputs when their positions extrapolate).
    """
    if len(set(vocab)) != len(vocab):
        raise ValueError(f"the vocabulary repeats characters: {vocab!r}")
    core = Tokenizer(models.WordLevel({ch: i for i, ch in enumerate(vocab)}))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    extra = {} if block_size is None else {"model_max_length": block_size}
    return PreTrainedTokenizerFast(tokenizer_object=core, clean_up_tokenization_spaces=False, **extra)
